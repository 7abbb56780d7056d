"""VCC's attention, the reference: softmax attention over the compressed rows with an additive per-key logit bias
(docs/methods/vcc.md, whose § numbers follow the method spec; paper: Zeng et al., arXiv 2305.04241).

On the compressed sequence ``S X`` a VCC layer runs the block's unchanged multi-head attention with the diagonal
``D`` of segment lengths inside the softmax (§2.2, paper Eq. 7-9 with Eq. 50): a key standing for a segment of
``s`` tokens gets logit bias ``+log s`` (§2.3: ``exp(P (S_c C)^T) D S_c`` = ``exp`` of the mean logit per token),
VIP and single-token keys get 0. §2.5 adds the straight-through gate ``δ`` (value 0) and ``-1e9`` on masked keys::

    bias_j = mask_j + log D_j + δ_j
    A      = softmax(q k^T / sqrt(d_h) + bias) v          (softmax in fp32)

The stack wrapper (``longctx/attention/vcc/stack.py``) builds the rows and ``bias``; this is the whole sequence at
once (O(R^2) logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e9  # masked keys: exp underflows to exactly 0 in fp32 logits (§8.13)


def biased_attention(q, k, v, key_bias):
    """softmax(q k^T / sqrt(d_h) + key_bias) v in fp32, returned in v's dtype.

    q, k: [B, H, R, D]; v: [B, H, R, Dv]; key_bias: [B, R] (added to every query's logit of that key)."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32) * scale, k.astype(jnp.float32))
    p = jax.nn.softmax(s + key_bias.astype(jnp.float32)[:, None, None, :], axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32)).astype(v.dtype)


__all__ = ["NEG", "biased_attention"]
