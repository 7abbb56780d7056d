import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import time, numpy as np, jax, jax.numpy as jnp
T=8192; D=256
x=np.random.randn(T,D).astype(np.float32); dy=np.random.randn(T,D).astype(np.float32)
def tm(f, n=30):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
xj, dyj = map(jnp.asarray, (x,dy))
H=jax.lax.Precision.HIGHEST
vs=[("x.T@dy", lambda x,dy: x.T@dy), ("barrier(x.T)@dy", lambda x,dy: jax.lax.optimization_barrier(x.T)@dy),
    ("(barrier(dy.T)@x).T", lambda x,dy: (jax.lax.optimization_barrier(dy.T)@x).T),
    ("fwd x@W", lambda x,dy: x@dy[:256]), ("dy@W.T", lambda x,dy: dy@dy[:256].T)]
for name, f in vs:
    fj=jax.jit(f)
    print(name, round(tm(lambda: jax.block_until_ready(fj(xj,dyj))),2))
