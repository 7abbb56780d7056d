"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, jax, jax.numpy as jnp
def t(f,*a,n=10):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(n):
        s=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-s)
    return round(1e3*statistics.median(ts),2)
for shape in [(1,4,8192,64),(4,1,8192,64),(4,8192,1,64),(16,1,4,512,64),(2,2,8192,64)]:
    a=jax.random.normal(jax.random.key(0),shape); b=jax.random.normal(jax.random.key(1),shape)
    print(shape, "sum(a*b)", t(jax.jit(lambda a,b: jnp.sum(a*b,-1)),a,b), "sum(a*a)", t(jax.jit(lambda a: jnp.sum(a*a,-1)),a),
          "sum(a+b)", t(jax.jit(lambda a,b: jnp.sum(a+b,-1)),a,b), "sum(a*b,ax2)", t(jax.jit(lambda a,b: jnp.sum(a*b,-2)),a,b),
          "sum(a*b,-1,keepdims)", t(jax.jit(lambda a,b: jnp.sum(a*b,-1,keepdims=True)),a,b), flush=True)
