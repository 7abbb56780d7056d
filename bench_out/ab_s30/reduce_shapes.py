"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, jax, jax.numpy as jnp
def t(f,*a,n=20):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(n):
        s=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-s)
    return round(1e3*statistics.median(ts),3)
for shape in [(1,4,8192,64),(4,8192,64),(2,4,8192,64),(1,4,1024,1023),(1,4,8,128,1023),(1,8192,256),(1,4,64,128,64),(32768,64)]:
    a=jax.random.normal(jax.random.key(0),shape); b=jax.random.normal(jax.random.key(1),shape)
    print(shape, "sum", t(jax.jit(lambda a: jnp.sum(a,-1)),a), "sum(a*b)", t(jax.jit(lambda a,b: jnp.sum(a*b,-1)),a,b),
          "max", t(jax.jit(lambda a: jnp.max(a,-1)),a), "sum(exp)", t(jax.jit(lambda a: jnp.sum(jnp.exp(a),-1)),a), flush=True)
