"""x @ W whose weight gradient xᵀ g is formed from x transposed in blocks of 512 rows first (a probe, session 32:
faster alone, slower inside the peer layer; see BENCHMARKS.md)."""
import jax
import jax.numpy as jnp

from longctx.xla_cpu import transposed


@jax.custom_vjp
def mm_i(x, W):
    return x @ W


def _fwd(x, W):
    return x @ W, (x, W)


def _bwd(res, g):
    x, W = res
    N, d = x.shape
    xb = transposed(x.reshape(N // 512, 512, d))
    return g @ W.T, jnp.einsum("bdn,bne->de", xb, g.reshape(N // 512, 512, g.shape[1]))


mm_i.defvjp(_fwd, _bwd)
