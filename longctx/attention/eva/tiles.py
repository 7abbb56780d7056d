"""EVA's tile arithmetic shared by the XLA tiles (``xla.py``) and their packed-row form (``packed.py``): a tile's
chunk logits, its joint softmax over local keys and chunks (eq. 16), and the map over tiles under a logit budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longctx.attention.eva.common import NEG, PLAIN, EVAOptions, TileOps
from pallas_kernels.precision import acc_einsum


def chunk_logits(q, k_hat, k_raw, k_raw_valid, scale: float, chunk_logit: str):
    """[B,H,Tq,C] (float32): s q·k̂_c (eq. 16) or, 'exact_lse', logsumexp_{m∈P_c} s q·k_m (eq. 13); the keys are
    cast to q's dtype."""
    if chunk_logit == "rep":
        return scale * acc_einsum("bhqd,bhcd->bhqc", q, k_hat.astype(q.dtype))
    s = scale * acc_einsum("bhqd,bhcpd->bhqcp", q, k_raw.astype(q.dtype))
    s = jnp.where(k_raw_valid[:, None], s, NEG)  # k_raw_valid: [B|1, 1, C, P] -> broadcast
    return jax.nn.logsumexp(s, axis=-1)


def joint_tile(q, k, v, chunks, lmask, cmask, bias, drop, opts: EVAOptions, scale: float, ops: TileOps = PLAIN):
    """Eq. 16 of a tile of queries q [B,H,Tq,d] over its local keys k, v [B,H,Tk,*] and the chunks (k̂, β, k_raw,
    k_raw_valid), all in the compute dtype (q's), given its masks ``lmask`` [..,Tq,Tk], ``cmask`` [..,Tq,C]
    (broadcastable to the logits), the bias (or None) and the dropout multipliers ``drop`` = (local, chunk) or None
    (:func:`attend_tile` builds them from absolute positions; a packed row from each document's own,
    ``packed.py``). Returns float32 outputs [B,H,Tq,dv]."""
    k_hat, beta, k_raw, k_raw_valid = chunks
    cd = q.dtype
    a_loc = scale * acc_einsum("bhqd,bhkd->bhqk", q, k)
    if bias is not None:
        a_loc = a_loc + bias
    a_loc = jnp.where(lmask, a_loc, NEG)
    a_ch = jnp.where(cmask, chunk_logits(q, k_hat, k_raw, k_raw_valid, scale, opts.chunk_logit), NEG)
    m = jnp.maximum(jnp.max(a_loc, axis=-1, initial=NEG), jnp.max(a_ch, axis=-1, initial=NEG))
    m = jax.lax.stop_gradient(m)[..., None]
    p_loc = jnp.where(lmask, jnp.exp(a_loc - m), 0.0)
    p_ch = jnp.where(cmask, jnp.exp(a_ch - m), 0.0)
    denom = jnp.sum(p_loc, axis=-1) + jnp.sum(p_ch, axis=-1)
    if drop is not None:
        # dropout on the joint normalized weights == drop unnormalized p, keep the normalizer (§9.12)
        p_loc, p_ch = p_loc * drop[0], p_ch * drop[1]
    num = acc_einsum("bhqk,bhkd->bhqd", p_loc.astype(cd), v)
    num = num + acc_einsum("bhqc,bhcd->bhqd", p_ch.astype(cd), beta)
    return ops.row_scale(num, 1.0 / jnp.maximum(denom, 1e-30))  # empty rows (only if W = 0) give 0


def map_tiles(fn, xs, n_tiles: int, cost_per_tile: int, budget: int):
    """Apply fn over the leading tile axis: vmap when all tiles fit the logit budget, else lax.map in batches."""
    bs = max(1, budget // max(cost_per_tile, 1))
    if bs >= n_tiles:
        return jax.vmap(fn)(*xs)
    return jax.lax.map(lambda a: fn(*a), xs, batch_size=bs)
