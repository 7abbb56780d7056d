"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, sys
import jax, jax.numpy as jnp, numpy as np, torch
torch.set_num_threads(2)
def t(f, *a, n=30):
    f(*a); ts=[]
    for _ in range(n):
        s=time.perf_counter(); r=f(*a); jax.block_until_ready(r) if not isinstance(r, torch.Tensor) else None; ts.append(time.perf_counter()-s)
    return statistics.median(ts)
HI=jax.lax.Precision.HIGHEST
for (bq,bk) in [(1024,512),(512,512),(256,512),(128,512),(1024,1024)]:
    q=jax.random.normal(jax.random.key(0),(4,bq,64)); k=jax.random.normal(jax.random.key(1),(4,bk,64)); p=jax.random.normal(jax.random.key(2),(4,bq,bk))
    f1=jax.jit(lambda q,k: jnp.einsum("hqd,hkd->hqk",q,k,precision=HI)); f2=jax.jit(lambda p,k: jnp.einsum("hqk,hkd->hqd",p,k,precision=HI))
    f3=jax.jit(lambda q,k: jnp.exp(jnp.einsum("hqd,hkd->hqk",q,k,precision=HI)-3.0))
    fl=2*4*bq*bk*64
    a=t(f1,q,k); b=t(f2,p,k); c=t(f3,q,k)
    tq,tk,tp=(torch.from_numpy(np.asarray(x)) for x in (q,k,p))
    ta=t(lambda a,b: torch.bmm(a,b.transpose(1,2)),tq,tk); tb=t(lambda a,b: torch.bmm(a,b),tp,tk)
    print(f"{bq}x{bk}: jax qk {fl/a/1e9:.0f} GF/s pv {fl/b/1e9:.0f} qk+exp {fl/c/1e9:.0f} | torch qk {fl/ta/1e9:.0f} pv {fl/tb/1e9:.0f}", flush=True)
