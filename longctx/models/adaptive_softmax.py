"""Output layers for large vocabularies (WikiText-103: 267,735 words).

* :func:`chunked_softmax_nll` -- the exact full-softmax NLL of a dense output layer
  ``logits = h @ W + b`` without materialising ``[..., V]``: a ``lax.scan`` over vocabulary
  chunks keeps a running (max, sum-exp) per position; the scan body is rematerialised in the
  backward pass, so forward and backward both hold only ``[N, chunk]`` logits at a time.
* :class:`AdaptiveSoftmax` -- the adaptive softmax of Grave et al. 2017 with the projected
  tail clusters of Transformer-XL / Baevski & Auli: a head over the ``cutoffs[0]`` most
  frequent words plus one logit per tail cluster, and tail cluster ``i`` (words
  ``[cutoffs[i-1], cutoffs[i])``) scoring from a projection of width ``d_model // div_val**i``.
  ``log p(w) = log p_head(w)`` for head words and
  ``log p_head(cluster i) + log p_i(w)`` for words of tail cluster ``i``.
  :meth:`AdaptiveSoftmax.nll` is the exact NLL of that model (tail normalisers through the
  chunked log-sum-exp, so no ``[..., V]`` tensor); :meth:`AdaptiveSoftmax.log_probs` gives
  the full ``[..., V]`` log-distribution (for tests, sampling and small vocabularies).

Word ids must be sorted by frequency (the ``words`` tokenizer's vocabulary is), so that the
head holds the frequent words. With static shapes, each tail's normaliser is computed for
every position (compute ``N * size_i * d_i``), not only for positions whose target falls in
that cluster as in the PyTorch implementations; the projection keeps it cheap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longctx.models.layers import linear

_NEG = -1e30


def chunked_logsumexp(x, W, b=None, *, chunk: int = 8192):
    """``logsumexp(x @ W + b, axis=-1)`` for ``x [N, d]``, ``W [d, V]``, ``b [V]``, in float32,
    holding ``[N, chunk]`` logits at a time."""
    d, V = W.shape
    chunk = max(1, min(int(chunk), V))
    n_chunks = -(-V // chunk)
    pad = n_chunks * chunk - V
    Wc = jnp.pad(W, ((0, 0), (0, pad))).reshape(d, n_chunks, chunk).transpose(1, 0, 2)
    bc = jnp.zeros((V,), jnp.float32) if b is None else b.astype(jnp.float32)
    bc = jnp.pad(bc, (0, pad)).reshape(n_chunks, chunk)
    valid = (jnp.arange(n_chunks * chunk) < V).reshape(n_chunks, chunk)
    x = x.astype(jnp.float32)

    @jax.checkpoint
    def body(carry, xs):
        m, s = carry
        w, bias, ok = xs
        logits = jnp.dot(x, w.astype(jnp.float32), preferred_element_type=jnp.float32) + bias
        logits = jnp.where(ok, logits, _NEG)
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        return (m_new, s), None

    n = x.shape[0]
    (m, s), _ = jax.lax.scan(body, (jnp.full((n,), _NEG, jnp.float32), jnp.zeros((n,), jnp.float32)), (Wc, bc, valid))
    return m + jnp.log(s)


def _target_logit(x, W, b, idx):
    """``(x @ W + b)[n, idx[n]]`` without the full product: gathers the target columns."""
    cols = jnp.take(W, idx, axis=1).T.astype(jnp.float32)  # [N, d]
    out = jnp.sum(x.astype(jnp.float32) * cols, axis=-1)
    if b is not None:
        out = out + jnp.take(b, idx).astype(jnp.float32)
    return out


def chunked_softmax_nll(h, W, targets, chunk: int = 8192, bias=None):
    """Exact ``-log softmax(h @ W + bias)[targets]`` with shape ``targets.shape``.

    ``h [..., d]``, ``W [d, V]`` (an ``nnx.Linear`` kernel; for tied embeddings pass
    ``embedding.T``), ``targets [...]`` int, ``bias [V]`` or None. Differentiable in h, W, bias.
    """
    lead = targets.shape
    x = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    lse = chunked_logsumexp(x, W, bias, chunk=chunk)
    return (lse - _target_logit(x, W, bias, t)).reshape(lead)


class AdaptiveSoftmax(nnx.Module):
    """Adaptive softmax output layer.

    ``AdaptiveSoftmax(d_model, vocab_size, cutoffs=(20000, 40000, 200000), div_val=4.0, rngs=...)``:
    the head scores ``cutoffs[0]`` words + ``len(cutoffs)`` cluster tokens from ``h`` directly;
    tail ``i`` (1-based) projects ``h`` to ``max(1, d_model // div_val**i)`` dims and scores its
    ``cutoffs[i] - cutoffs[i-1]`` words (the last tail ends at ``vocab_size``).
    """

    def __init__(self, d_model: int, vocab_size: int, cutoffs=(20000, 40000, 200000), div_val: float = 4.0, *,
                 rngs: nnx.Rngs, chunk: int = 8192, param_dtype=jnp.float32, dtype=None, flat_rows: bool = False):
        cutoffs = [int(c) for c in cutoffs]
        if not cutoffs or any(b <= a for a, b in zip([0] + cutoffs, cutoffs + [vocab_size])):
            raise ValueError(f"cutoffs {cutoffs} must be increasing and inside (0, vocab_size={vocab_size})")
        self.d_model, self.vocab_size, self.div_val, self.chunk = d_model, vocab_size, float(div_val), int(chunk)
        self.bounds = [0] + cutoffs + [vocab_size]
        self.n_tails = len(cutoffs)
        init = nnx.initializers.normal(0.02)
        kw = {"param_dtype": param_dtype, "dtype": dtype, "flat_rows": flat_rows}  # dtype: the compute dtype (None: the inputs')
        self.head = linear(d_model, cutoffs[0] + self.n_tails, ("embed", "vocab"), kernel_init=init, rngs=rngs, **kw)
        projs, outs = [], []
        for i in range(1, self.n_tails + 1):
            d_i = max(1, int(d_model // (self.div_val ** i)))
            size = self.bounds[i + 1] - self.bounds[i]
            projs.append(linear(d_model, d_i, ("embed", None), use_bias=False, kernel_init=init, rngs=rngs, **kw))
            outs.append(linear(d_i, size, (None, "vocab"), kernel_init=init, rngs=rngs, **kw))
        self.tail_proj = nnx.List(projs)
        self.tail_out = nnx.List(outs)

    def head_log_probs(self, h):
        return jax.nn.log_softmax(self.head(h).astype(jnp.float32), axis=-1)

    def log_probs(self, h):
        """Full log-distribution ``[..., vocab_size]`` (materialises V: for tests and small vocabularies)."""
        head_lp = self.head_log_probs(h)
        c0 = self.bounds[1]
        parts = [head_lp[..., :c0]]
        for i in range(self.n_tails):
            logits = self.tail_out[i](self.tail_proj[i](h)).astype(jnp.float32)
            parts.append(head_lp[..., c0 + i, None] + jax.nn.log_softmax(logits, axis=-1))
        return jnp.concatenate(parts, axis=-1)

    def nll(self, h, targets):
        """Exact ``-log p(targets | h)`` under this adaptive model, shape ``targets.shape``."""
        lead = targets.shape
        x = h.reshape(-1, h.shape[-1])
        t = targets.reshape(-1).astype(jnp.int32)
        head_lp = self.head_log_probs(x)  # [N, c0 + n_tails]
        c0 = self.bounds[1]
        in_head = t < c0
        lp = jnp.take_along_axis(head_lp, jnp.where(in_head, t, 0)[:, None], axis=-1)[:, 0]
        for i in range(self.n_tails):
            lo, hi = self.bounds[i + 1], self.bounds[i + 2]
            here = (t >= lo) & (t < hi)
            p = self.tail_proj[i](x)
            out = self.tail_out[i]
            W, b = out.kernel[...], out.bias[...]
            idx = jnp.clip(t - lo, 0, hi - lo - 1)
            tail_lp = _target_logit(p, W, b, idx) - chunked_logsumexp(p, W, b, chunk=self.chunk)
            lp = jnp.where(here, head_lp[:, c0 + i] + tail_lp, lp)
        return (-lp).reshape(lead)
