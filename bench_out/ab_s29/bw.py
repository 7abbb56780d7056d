import time, jax, jax.numpy as jnp, numpy as np
for n in [4*1024*1023, 16*1024*1024]:
    x=jnp.asarray(np.random.randn(n).astype(np.float32)); y=jnp.asarray(np.random.randn(n).astype(np.float32))
    for name,f in [("copy*2",lambda x,y: x*2.0),("exp",lambda x,y: jnp.exp(x)),("fma2",lambda x,y: x*y+1.0)]:
        c=jax.jit(f); jax.block_until_ready(c(x,y)); ts=[]
        for _ in range(30):
            t=time.perf_counter(); jax.block_until_ready(c(x,y)); ts.append(time.perf_counter()-t)
        t=np.median(ts); nb=(3 if name=="fma2" else 2)*4*n
        print(f"n={n} {name}: {t*1e3:.2f} ms  {nb/t/1e9:.1f} GB/s")
