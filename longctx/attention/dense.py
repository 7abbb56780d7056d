"""Exact softmax attention, the baseline every method is compared with.

Two paths compute the same function:

* ``naive``: materializes the [Tq, Tk] score matrix.
* ``blockwise``: online softmax over key blocks inside query blocks, so memory
  is O(block_q * block_k) per head; causal key blocks wholly in the future are
  skipped. Runs 65k-token forwards on a CPU.

The state is a KV cache of fixed capacity (``init_state(batch, max_len)``);
slots are right-aligned, so slot j of a cache of capacity M that has seen
``length`` tokens holds absolute position ``length - M + j`` (invalid when < 0).
Feeding more than ``max_len`` tokens in total raises :class:`CapacityError`
(under jit too), unless ``kv_window=True`` names the sliding-window cache as
a feature: then the cache keeps the newest ``max_len`` keys and older ones are
dropped by design (Transformer-XL-style memory, not exact attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections

from longctx.attention.base import AttentionCore, ContractCase, DropIn, check_capacity, check_qkv, require
from longctx.xla_cpu import rowdot

NEG_INF = -1e30


def positions_mask(q_pos, k_pos, k_valid, causal: bool):
    """[Tq, Tk] boolean: key visible to query."""
    mask = k_valid[None, :]
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    return mask


def naive_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool):
    """Reference exact attention with explicit positions. Shapes as the contract."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    mask = positions_mask(q_pos, k_pos, k_valid, causal)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(m)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32)) / jnp.maximum(den, 1e-30)
    return out.astype(v.dtype)


def _pad_axis(x, axis: int, multiple: int, value=0):
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, n_blocks: int, block: int):
    """[B, H, n*block, D] -> [n, B, H, block, D]."""
    B, H, _, D = x.shape
    return x.reshape(B, H, n_blocks, block, D).transpose(2, 0, 1, 3, 4)


def _unblocks(x, length: int):
    """[n, B, H, block, ...] -> [B, H, length, ...] (the inverse of _blocks, padding cut)."""
    n, B, H, block = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape(B, H, n * block, *x.shape[4:])[:, :, :length]


def _layout(q_pos, k_pos, k_valid, bq: int, bk: int):
    """Padded, blocked positions: query positions [nq, bq], key positions/validity [nk, bk], and the
    earliest valid key position of each key block [nk] (to skip blocks wholly in the future)."""
    qpos = _pad_axis(q_pos, 0, bq, value=jnp.iinfo(jnp.int32).max // 2)
    kpos = _pad_axis(k_pos, 0, bk)
    kval = _pad_axis(k_valid, 0, bk, value=False)
    qposb, kposb, kvalb = qpos.reshape(-1, bq), kpos.reshape(-1, bk), kval.reshape(-1, bk)
    kmin = jnp.min(jnp.where(kvalb, kposb, jnp.iinfo(jnp.int32).max), axis=1)
    return qposb, kposb, kvalb, kmin


def _visit(step, causal: bool, qpi, kmi, carry, skipped):
    """Run ``step(carry)`` unless the key block lies wholly after every query of the block (causal)."""
    if not causal:
        return step(carry)
    return jax.lax.cond(kmi <= jnp.max(qpi), step, skipped, carry)


def _flash_forward(qb, kb, vb, qposb, kposb, kvalb, kmin, causal: bool):
    """Online softmax over key blocks for every query block. qb is pre-scaled, all fp32, blocked.
    Returns the output blocks [nq, B, H, bq, Dv] and the log-sum-exp [nq, B, H, bq]
    (NEG_INF for a query that sees no key)."""
    _, B, H, bq, _ = qb.shape
    Dv = vb.shape[-1]

    def one_query_block(args):
        qi, qpi = args

        def step(carry, xs):
            ki, vi, kpi, kvi, kmi = xs

            def compute(carry):
                m, l, acc = carry
                s = jnp.einsum("bhqd,bhkd->bhqk", qi, ki)
                mask = positions_mask(qpi, kpi, kvi, causal)
                s = jnp.where(mask, s, NEG_INF)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                l_new = l * corr + jnp.sum(p, axis=-1)
                acc_new = acc * corr[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vi)
                return m_new, l_new, acc_new

            return _visit(compute, causal, qpi, kmi, carry, lambda c: c), None

        init = (
            jnp.full((B, H, bq), NEG_INF, jnp.float32),
            jnp.zeros((B, H, bq), jnp.float32),
            jnp.zeros((B, H, bq, Dv), jnp.float32),
        )
        (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kposb, kvalb, kmin))
        out = acc / jnp.maximum(l, 1e-30)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), NEG_INF)
        return out, lse

    return jax.lax.map(one_query_block, (qb, qposb))


def _flash_backward(qb, kb, vb, ob, lseb, dob, qposb, kposb, kvalb, kmin, causal: bool):
    """Gradients of the blocked attention from the saved log-sum-exp (FlashAttention-2's backward):
    each visible (query block, key block) pair recomputes its probabilities once and adds its share
    of dq (carried along the key blocks) and of dk, dv (summed over the query blocks)."""
    delta = rowdot(dob, ob)  # [nq, B, H, bq]: rowsum(dO * O), as a dot (longctx.xla_cpu)
    zeros_k, zeros_v = jnp.zeros(kb.shape[1:], jnp.float32), jnp.zeros(vb.shape[1:], jnp.float32)

    def query_block(dkv, xs):
        qi, doi, lsei, di, qpi = xs

        def key_block(dq, ys):
            ki, vi, kpi, kvi, kmi = ys

            def compute(dq):
                s = jnp.einsum("bhqd,bhkd->bhqk", qi, ki)
                mask = positions_mask(qpi, kpi, kvi, causal)
                p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)
                dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vi)
                ds = p * (dp - di[..., None])
                dv = jnp.einsum("bhqk,bhqd->bhkd", p, doi)
                dk = jnp.einsum("bhqk,bhqd->bhkd", ds, qi)
                return dq + jnp.einsum("bhqk,bhkd->bhqd", ds, ki), (dk, dv)

            return _visit(compute, causal, qpi, kmi, dq, lambda dq: (dq, (zeros_k, zeros_v)))

        dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros_like(qi), (kb, vb, kposb, kvalb, kmin))
        return (dkv[0] + dk, dkv[1] + dv), dq

    init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    (dk, dv), dq = jax.lax.scan(query_block, init, (qb, dob, lseb, delta, qposb))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _blockwise(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk):
    return _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk)[0]


def _blockwise_fwd(q, k, v, q_pos, k_pos, k_valid, causal, bq, bk):
    Tq, D = q.shape[2], q.shape[3]
    qb = _blocks(_pad_axis(q * D**-0.5, 2, bq), -(-Tq // bq), bq)
    kb = _blocks(_pad_axis(k, 2, bk), -(-k.shape[2] // bk), bk)
    vb = _blocks(_pad_axis(v, 2, bk), -(-k.shape[2] // bk), bk)
    layout = _layout(q_pos, k_pos, k_valid, bq, bk)
    ob, lseb = _flash_forward(qb, kb, vb, *layout, causal)
    return _unblocks(ob, Tq), (qb, kb, vb, ob, lseb, layout, k_valid)


def _blockwise_bwd(causal, bq, bk, res, dout):
    qb, kb, vb, ob, lseb, layout, k_valid = res
    Tq, Tk, D = dout.shape[2], k_valid.shape[0], qb.shape[-1]
    dob = _blocks(_pad_axis(dout, 2, bq), ob.shape[0], bq)
    dq, dk, dv = _flash_backward(qb, kb, vb, ob, lseb, dob, *layout, causal)
    return _unblocks(dq, Tq) * D**-0.5, _unblocks(dk, Tk), _unblocks(dv, Tk), None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, block_q: int, block_k: int):
    """Exact attention by online softmax over key blocks (memory O(block_q*block_k)), with
    FlashAttention-2's backward: only the output and the per-query log-sum-exp are saved, and the
    backward recomputes each visible block's probabilities once."""
    Tq, Tk = q.shape[2], k.shape[2]
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    f32 = lambda x: x.astype(jnp.float32)
    out = _blockwise(f32(q), f32(k), f32(v), q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), k_valid.astype(bool),
                     causal, bq, bk)
    return out.astype(v.dtype)


def attend(q, k, v, q_pos, k_pos, k_valid, *, causal: bool, impl: str, block_q: int, block_k: int, auto_threshold: int):
    if impl == "auto":
        impl = "blockwise" if q.shape[2] * k.shape[2] > auto_threshold else "naive"
    if impl == "naive":
        return naive_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal)
    return blockwise_attention(q, k, v, q_pos, k_pos, k_valid, causal=causal, block_q=block_q, block_k=block_k)


class DenseAttention(AttentionCore):
    """Exact softmax attention; causal state = fixed-capacity KV cache."""

    name = "dense"
    exact = True
    # composed KV caches are exact but attend each slice to a whole-row buffer without the causal
    # skip; XLA's partitioner splits the queries and gathers K/V instead: 226 MiB against 1,847 MiB
    # of temporaries per device at 8k tokens over 8 devices (README, sequence parallelism)
    sequence_compose_in_training = False

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "impl": "auto",  # 'naive' | 'blockwise' | 'auto' (blockwise when Tq*Tk > auto_threshold)
                "block_q": 512,
                # 256 keys per step: causal forward+backward at 8k (B 1, 4 heads of 64), block_k 512 -> 256:
                # 1,704 / 1,792 -> 1,485 / 1,451 / 1,284 ms in one process (BENCHMARKS.md, 2026-11-24)
                "block_k": 256,
                "auto_threshold": 4096 * 4096,
                # False: the KV cache is exact and refuses to overflow. True: a sliding window of the
                # newest init_state(max_len) keys (older keys are dropped on purpose).
                "kv_window": False,
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        allowed = ("naive", "blockwise", "auto")
        require(cfg.impl in allowed, f"attention.dense.impl={cfg.impl!r}; allowed: {', '.join(allowed)}")
        require(cfg.block_q > 0 and cfg.block_k > 0, "attention.dense.block_q/block_k must be positive")
        require(cfg.auto_threshold > 0, "attention.dense.auto_threshold must be positive")

    @classmethod
    def bench_variants(cls):
        return {"naive": {"impl": "naive"}, "blockwise": {"impl": "blockwise"}}

    @classmethod
    def drop_in(cls):
        return DropIn("parameter-free: used as is")

    @classmethod
    def contract_cases(cls):
        return {
            "naive": ContractCase(cfg={"impl": "naive"}, length=40),
            "blockwise": ContractCase(cfg={"impl": "blockwise", "block_q": 8, "block_k": 8}, length=40,
                                      directions=("causal",)),
            "blockwise_bidirectional": ContractCase(cfg={"impl": "blockwise", "block_q": 8, "block_k": 8}, length=40,
                                                    directions=("bidirectional",), slow=True),
        }

    def _attend(self, q, k, v, q_pos, k_pos, k_valid):
        c = self.cfg
        return attend(
            q, k, v, q_pos, k_pos, k_valid,
            causal=self.causal, impl=c.impl, block_q=c.block_q, block_k=c.block_k, auto_threshold=c.auto_threshold,
        )

    def init_state(self, batch_size: int, max_len: int | None = None):
        if not self.causal:
            raise ValueError("dense: bidirectional attention has no prefix state")
        if max_len is None or max_len <= 0:
            raise ValueError("dense: init_state needs max_len (the KV-cache capacity in tokens)")
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        return {
            "k": jnp.zeros((batch_size, H, max_len, D), jnp.float32),
            "v": jnp.zeros((batch_size, H, max_len, Dv), jnp.float32),
            "length": jnp.zeros((), jnp.int32),
        }

    # -- sequence parallelism: the KV cache composes by concatenation --------------------------
    def sequence_refusal(self, slice_len: int) -> str | None:
        if self.cfg.kv_window:
            return "kv_window=True keeps only the newest max_len keys; composition needs the whole cache"
        return None

    def sequence_origin(self, batch_size: int, max_len: int, start):
        return {**self.init_state(batch_size, max_len), "length": jnp.asarray(start, jnp.int32)}

    def compose_states(self, a, b):
        # both caches are right-aligned (slot j <-> position length - M + j) and zero outside their
        # own tokens: move a's keys left by the number of b's tokens and add (an exact concatenation)
        shift = b["length"] - a["length"]
        moved = {name: jnp.roll(a[name], -shift, axis=2) for name in ("k", "v")}
        return {"k": moved["k"] + b["k"], "v": moved["v"] + b["v"], "length": b["length"]}

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None):
        check_qkv(q, k, v)
        T = q.shape[2]
        pos = jnp.arange(T, dtype=jnp.int32)
        if state is None:
            out = self._attend(q, k, v, pos, pos, jnp.ones((T,), bool))
            new_state = (
                {"k": k.astype(jnp.float32), "v": v.astype(jnp.float32), "length": jnp.asarray(T, jnp.int32)}
                if self.causal
                else None
            )
            return out, new_state
        if not self.causal:
            raise ValueError("dense: a bidirectional core takes no state")
        M = state["k"].shape[2]
        length = state["length"]
        if not self.cfg.kv_window:
            check_capacity(length + T, M, "dense: the KV cache holds {capacity} tokens (init_state max_len) but "
                           "{needed} were fed; build it with a larger max_len, or set attention.dense.kv_window=True "
                           "for a sliding window that drops the oldest keys")
        q_pos = length + pos
        k_pos = jnp.concatenate([length - M + jnp.arange(M, dtype=jnp.int32), q_pos])
        k_all = jnp.concatenate([state["k"].astype(q.dtype), k], axis=2)
        v_all = jnp.concatenate([state["v"].astype(v.dtype), v], axis=2)
        out = self._attend(q, k_all, v_all, q_pos, k_pos, k_pos >= 0)
        new_state = {
            "k": k_all[:, :, -M:].astype(jnp.float32),
            "v": v_all[:, :, -M:].astype(jnp.float32),
            "length": length + T,
        }
        return out, new_state


__all__ = ["DenseAttention", "attend", "blockwise_attention", "naive_attention", "positions_mask"]
