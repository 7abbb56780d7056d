"""Loss + gradient of a 2-layer MLP on [B, T, C] inputs, the matmuls applied to the 3-D array or to it flattened
to [B*T, C] (what longctx.models.layers.flat_last does), timed interleaved in one process (session 26).

    .venv/bin/python bench_out/flat_s26/mlp_flat.py B T C F
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

B, T, C, F = map(int, sys.argv[1:5])
x = jax.random.normal(jax.random.key(1), (B, T, C))
p = (jax.random.normal(jax.random.key(2), (C, F)) * C**-0.5, jnp.zeros(F),
     jax.random.normal(jax.random.key(3), (F, C)) * F**-0.5, jnp.zeros(C))


def mlp_3d(p, x):
    W1, b1, W2, b2 = p
    return jax.nn.gelu(x @ W1 + b1) @ W2 + b2


def mlp_2d(p, x):
    W1, b1, W2, b2 = p
    x2 = x.reshape(-1, x.shape[-1])
    return (jax.nn.gelu(x2 @ W1 + b1) @ W2 + b2).reshape(x.shape)


fs = {n: jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(jnp.sin(f(p, x))), argnums=(0, 1)))
      for n, f in (("3d", mlp_3d), ("2d", mlp_2d))}
for f in fs.values():
    for _ in range(2):
        jax.block_until_ready(f(p, x))
ts = {k: [] for k in fs}
for _ in range(11):
    for k, f in fs.items():
        t = time.perf_counter()
        jax.block_until_ready(f(p, x))
        ts[k].append(time.perf_counter() - t)
print(f"B {B} T {T} C {C} F {F}: " + ", ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in ts.items()))
