import time, jax, jax.numpy as jnp, numpy as np
from longctx.host_memory import keep_freed_memory
keep_freed_memory()
HI=jax.lax.Precision.HIGHEST
r=lambda *s: jnp.asarray(np.random.randn(*s).astype(np.float32))
q=r(4,1024,64); kh=r(4,1023,64); khT=r(4,64,1023); P=r(4,1024,1023); beta=r(4,1023,64)
def bench(name,f,*a,fl):
    c=jax.jit(f); jax.block_until_ready(c(*a)); ts=[]
    for _ in range(40):
        t=time.perf_counter(); jax.block_until_ready(c(*a)); ts.append(time.perf_counter()-t)
    t=np.median(ts); print(f"{name:30s} {t*1e3:.3f} ms {fl/t/1e9:.0f} GF/s")
fl=2*4*1024*1023*64
bench("S NT (ynn)", lambda q,k: jnp.einsum("bqd,bcd->bqc",q,k,precision=HI), q, kh, fl=fl)
bench("S NN kT", lambda q,k: jnp.einsum("bqd,bdc->bqc",q,k,precision=HI), q, khT, fl=fl)
bench("S NT + exp", lambda q,k: jnp.exp(jnp.einsum("bqd,bcd->bqc",q,k,precision=HI)), q, kh, fl=fl)
bench("PV NN", lambda p,b: jnp.einsum("bqc,bcd->bqd",p,b,precision=HI), P, beta, fl=fl)
bench("dkhat TN", lambda p,q: jnp.einsum("bqc,bqd->bcd",p,q,precision=HI), P, q, fl=fl)
bench("dkhat TN ->dc", lambda p,q: jnp.einsum("bqc,bqd->bdc",p,q,precision=HI), P, q, fl=fl)
bench("exp only", lambda p: jnp.exp(p), P, fl=fl)
bench("dkhat per-head 2D TN", lambda p,q: jnp.stack([p[h].T @ q[h] for h in range(4)]), P, q, fl=fl)
bench("dkhat per-head 2D ->dc", lambda p,q: jnp.stack([q[h].T @ p[h] for h in range(4)]), P, q, fl=fl)
bench("dkhat fold: qT@P as [64, 4*...]", lambda p,q: jnp.einsum("bqd,bqc->bdc",q,p,precision=HI), P, q, fl=fl)
