"""Training-free "drop-in" settings for the quality benchmark: how a method with learned
parts is compared with exact softmax attention on the same q, k, v without training.

* parameter-free methods (no ``nnx.Param``) run as they are;
* a method listed in ``DROP_IN`` runs in the setting documented there;
* any other method with learned parts is reported as 'n/a' with the reason (no mode is
  invented for it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from longctx.bench.cores import build_core, has_params


@dataclasses.dataclass
class DropIn:
    description: str
    overrides: dict
    # (core, q, k, v, k_fit, seed) -> (q, k, v) after adjusting the core in place
    setup: Callable | None = None


def kmeans(x, S: int, *, iters: int = 10, seed: int = 0):
    """Per-head Lloyd k-means. x [H, N, D] -> centroids [H, S, D] (init: S points sampled from x)."""
    H, N, D = x.shape
    idx = jax.random.choice(jax.random.key(seed), N, (S,), replace=N < S)
    c = x[:, idx]

    @jax.jit
    def step(c):
        d = jnp.sum(x * x, -1)[..., None] - 2 * jnp.einsum("hnd,hsd->hns", x, c) + jnp.sum(c * c, -1)[:, None]
        z = jnp.argmin(d, axis=-1)
        onehot = jax.nn.one_hot(z, S, dtype=x.dtype)
        cnt = jnp.sum(onehot, axis=1)
        sums = jnp.einsum("hns,hnd->hsd", onehot, x)
        return jnp.where(cnt[..., None] > 0, sums / jnp.maximum(cnt, 1.0)[..., None], c)

    for _ in range(iters):
        c = step(c)
    return c


def _tvq_setup(core, q, k, v, k_fit, seed):
    """Transformer-VQ: no learned position bias (W_R = u = v = 0), qk_norm off with q pre-scaled by
    Dk^-1/2 (so the logits are q·k/sqrt(Dk) as in exact attention), codebook = per-head k-means
    (10 Lloyd iterations) of held-out keys ``k_fit`` (same distribution, different sample)."""
    D = q.shape[-1]
    for name in ("W_R", "u", "v"):
        var = getattr(core, name)
        var[...] = jnp.zeros_like(var[...])
    H = k_fit.shape[1]
    x = jnp.moveaxis(k_fit.astype(jnp.float32), 1, 0).reshape(H, -1, D)
    cents = kmeans(x, int(core.cfg.codebook_size), seed=seed)
    core.c_sum[...] = cents.astype(core.c_sum[...].dtype)
    core.c_count[...] = jnp.ones_like(core.c_count[...])
    return q * D**-0.5, k, v


DROP_IN: dict[str, DropIn] = {
    "eva": DropIn(
        "chunk_rep='identity' (k̂_c = chunk mean of k, µ_c from chunk means of q and k; no learned projection), "
        "use_rpe=False (no learned position bias); other options default",
        {"chunk_rep": "identity", "use_rpe": False},
    ),
    "transformer_vq": DropIn(
        "qk_norm=False with q·Dk^-1/2, Transformer-XL bias off (W_R=u=v=0), codebook = per-head k-means "
        "(10 iterations) of held-out keys",
        {"qk_norm": False},
        _tvq_setup,
    ),
}


def resolve(method: str, overrides: dict, *, heads: int, head_dim: int, causal: bool) -> tuple[DropIn | None, str]:
    """(DropIn, description) or (None, reason it is n/a). Raises ConfigError for an unsupported direction."""
    if method in DROP_IN:
        d = DROP_IN[method]
        return DropIn(d.description, {**overrides, **d.overrides}, d.setup), d.description
    core = build_core(method, overrides, heads=heads, head_dim=head_dim, causal=causal)
    if not has_params(core):
        return DropIn("parameter-free: used as is", dict(overrides)), "parameter-free: used as is"
    return None, ("n/a: the method has learned parameters and no training-free drop-in setting "
                  "(add one to longctx/bench/dropin.py DROP_IN)")
