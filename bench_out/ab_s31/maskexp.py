import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import time, numpy as np, jax, jax.numpy as jnp
def tm(f, n=30):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
r=np.random.default_rng(0)
s=jnp.asarray(r.standard_normal((4,1024,512)).astype(np.float32)); m=jnp.asarray(r.standard_normal((4,1024)).astype(np.float32))
off=6144
iota_mask=lambda: (off+jnp.arange(512))[None,:] <= (off+jnp.arange(1024))[:,None]
npmask=np.arange(512)[None,:] <= np.arange(1024)[:,None]
npbias=np.where(npmask,0.0,-1e30).astype(np.float32)
vs={"plain exp": lambda s,m: jnp.exp(s-m[...,None]),
    "iota select": lambda s,m: jnp.exp(jnp.where(iota_mask(), s, -1e30)-m[...,None]),
    "np bool select": lambda s,m: jnp.exp(jnp.where(npmask, s, -1e30)-m[...,None]),
    "np bias add": lambda s,m: jnp.exp(s+npbias-m[...,None]),
    "iota select + sum": lambda s,m: jnp.sum(jnp.exp(jnp.where(iota_mask(), s, -1e30)-m[...,None]),-1),
    "np bias + sum": lambda s,m: jnp.sum(jnp.exp(s+npbias-m[...,None]),-1),
}
for k,f in vs.items():
    ff=jax.jit(f); print(k, round(tm(lambda: ff(s,m).block_until_ready()),3))
