"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, jax, jax.numpy as jnp
def t(f,*a,n=20):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(n):
        s=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-s)
    return round(1e3*statistics.median(ts),3)
HI=jax.lax.Precision.HIGHEST
for shape in [(16,1,4,512,64),(1,4,8192,64),(1,4,16,512,64),(4,8192,64)]:
    a=jax.random.normal(jax.random.key(0),shape); b=jax.random.normal(jax.random.key(1),shape)
    print(shape, "sum", t(jax.jit(lambda a,b: jnp.sum(a*b,-1)),a,b), "einsum", t(jax.jit(lambda a,b: jnp.einsum('...d,...d->...',a,b,precision=HI)),a,b))
