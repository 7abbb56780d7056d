#!/usr/bin/env python
import time, numpy as np, jax, jax.numpy as jnp
def tm(f, n=30):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
M=1024
for N in [1008,1012,1016,1020,1023,1024]:
    a=np.random.randn(4,M,64).astype(np.float32); b=np.random.randn(4,64,N).astype(np.float32)
    aj,bj=jnp.asarray(a),jnp.asarray(b)
    f2=jax.jit(lambda a,b: jnp.exp(jnp.einsum("bmk,bkn->bmn",a,b,precision="highest")*0.01))
    f3=jax.jit(lambda a,b: jnp.einsum("bmk,bkn->bmn",a,b,precision="highest"))
    print(N, round(tm(lambda: f3(aj,bj).block_until_ready()),2), round(tm(lambda: f2(aj,bj).block_until_ready()),2))
