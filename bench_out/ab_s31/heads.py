import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import time, numpy as np, jax, jax.numpy as jnp
T,C,H,D=8192,256,4,64
def tm(f, n=20):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
r=np.random.default_rng(0)
x=jnp.asarray(r.standard_normal((T,C)).astype(np.float32)); W=jnp.asarray(r.standard_normal((C,C)).astype(np.float32)*0.06)
g=jnp.asarray(r.standard_normal((H,T,D)).astype(np.float32))
vs={
 "A reshape-transpose": lambda x,W: (x@W).reshape(T,H,D).transpose(1,0,2),
 "B einsum htd": lambda x,W: jnp.einsum("tc,hcd->htd", x, W.reshape(C,H,D).transpose(1,0,2)),
 "C broadcast batched": lambda x,W: jnp.broadcast_to(x,(H,T,C)) @ W.reshape(C,H,D).transpose(1,0,2),
 "D per-head stack": lambda x,W: jnp.stack([x @ W[:, h*D:(h+1)*D] for h in range(H)]),
}
for k,f in vs.items():
    fg=jax.jit(jax.grad(lambda x,W,g: jnp.sum(f(x,W)*g), argnums=(0,1)))
    ff=jax.jit(f)
    print(k, "fwd", round(tm(lambda: ff(x,W).block_until_ready()),2), "fwd+bwd", round(tm(lambda: jax.block_until_ready(fg(x,W,g))),2))
