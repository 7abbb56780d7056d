"""Session 30 microbenchmark (see BENCHMARKS.md, session 30)."""
import time, statistics, jax, jax.numpy as jnp
def t(f,*a,n=20):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(n):
        s=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-s)
    return round(1e3*statistics.median(ts),3)
def rms(x): return x * jax.lax.rsqrt(jnp.mean(x*x,-1,keepdims=True)+1e-6)
def rms_flat(x): return rms(x.reshape(-1, x.shape[-1])).reshape(x.shape)
def ln(x, g, b):
    mu = jnp.mean(x, -1, keepdims=True); var = jnp.mean(jnp.square(x-mu), -1, keepdims=True)
    return (x-mu)*jax.lax.rsqrt(var+1e-5)*g+b
def ln_flat(x,g,b): return ln(x.reshape(-1,x.shape[-1]),g,b).reshape(x.shape)
for shape in [(1,4,8192,64),(8,256,1,128),(1,4,1024,64)]:
    x=jax.random.normal(jax.random.key(0),shape); w=jax.random.normal(jax.random.key(1),shape); g=jnp.ones(shape[-1]); b=jnp.zeros(shape[-1])
    r=[]
    for f in (rms, rms_flat):
        r.append(t(jax.jit(jax.grad(lambda x,f=f: jnp.sum(f(x)*w))),x))
    for f in (ln, ln_flat):
        r.append(t(jax.jit(jax.grad(lambda x,g,b,f=f: jnp.sum(f(x,g,b)*w),argnums=(0,1,2))),x,g,b))
    print(shape, "rms grad / flat", r[:2], "ln grad / flat", r[2:])
