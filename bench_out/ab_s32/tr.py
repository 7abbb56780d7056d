import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
T=8192
x=jnp.asarray(np.random.default_rng(0).standard_normal((1,T,256)).astype(np.float32))
W=jnp.asarray(np.random.default_rng(1).standard_normal((256,256)).astype(np.float32))
fs = {
 "transpose": lambda x, W: x.reshape(1,T,4,64).transpose(0,2,1,3) + 1.0,
 "slices": lambda x, W: jnp.stack([x[0,:,h*64:(h+1)*64] for h in range(4)])[None] + 1.0,
 "matmul": lambda x, W: x @ W,
 "matmul+tr": lambda x, W: (x @ W).reshape(1,T,4,64).transpose(0,2,1,3),
 "einsum_heads": lambda x, W: jnp.einsum("btc,chd->bhtd", x, W.reshape(256,4,64)),
 "perhead": lambda x, W: jnp.stack([x[0] @ W[:, h*64:(h+1)*64] for h in range(4)])[None],
 "Wt_first": lambda x, W: jnp.einsum("hdc,btc->bhtd", W.T.reshape(4,64,256), x),
}
js = {k: jax.jit(f) for k,f in fs.items()}
for k,f in js.items():
    for _ in range(3): jax.block_until_ready(f(x,W))
ts={k:[] for k in js}
for i in range(30):
    for k,f in js.items():
        t=time.perf_counter(); jax.block_until_ready(f(x,W)); ts[k].append(time.perf_counter()-t)
for k,v in ts.items(): print(f"{k:14s} {np.median(v)*1e3:.3f} ms")
