"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, jax, jax.numpy as jnp
def t(f,*a,n=20):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(n):
        s=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-s)
    return round(1e3*statistics.median(ts),3)
HI=jax.lax.Precision.HIGHEST
f0=lambda num,den: num/den[...,None]
f1=lambda num,den: jnp.einsum("...f,...->...f", num, 1.0/den, precision=HI)
f2=lambda num,den: jnp.einsum("...f,...->...f", num, 1.0/den)
for shape in [(1,4,128,64,64),(21,1,4,128,64),(1,4,8192,64),(8,4,8192,64)]:
    num=jax.random.normal(jax.random.key(0),shape); den=jax.random.uniform(jax.random.key(1),shape[:-1])+1; w=jax.random.normal(jax.random.key(2),shape)
    print(shape, [t(jax.jit(jax.grad(lambda n,d,f=f: jnp.sum(f(n,d)*w),argnums=(0,1))),num,den) for f in (f0,f1,f2)])
