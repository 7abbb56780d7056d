#!/usr/bin/env python
import time, numpy as np, jax, jax.numpy as jnp, torch
T=8192; D=256
x=np.random.randn(T,D).astype(np.float32); W=np.random.randn(D,D).astype(np.float32)*0.06; dy=np.random.randn(T,D).astype(np.float32)
def tm(f, n=30):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
xj, Wj, dyj = map(jnp.asarray, (x,W,dy))
xt, Wt, dyt = map(torch.from_numpy, (x,W,dy))
for name, fj, ft in [("fwd x@W", jax.jit(lambda x,W,dy: x@W), lambda: xt@Wt),
                     ("dX dy@W.T", jax.jit(lambda x,W,dy: dy@W.T), lambda: dyt@Wt.T),
                     ("dW x.T@dy", jax.jit(lambda x,W,dy: x.T@dy), lambda: xt.T@dyt),
                     ]:
    print(name, "jax", round(tm(lambda: jax.block_until_ready(fj(xj,Wj,dyj))),2), "torch", round(tm(ft),2))
