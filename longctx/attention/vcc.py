"""VCC: VIP-token centric compression (paper: Zeng et al., arXiv 2305.04241; method notes:
docs/methods/vcc.md, whose sections the § numbers below cite).

VCC acts on a whole pre-LN layer, not on q, k, v: before each layer the "rest" tokens are
compressed to a short multi-resolution list (the blocks the VIP tokens attend to most stay at
token resolution, every other block of k tokens becomes its mean), the unchanged layer (attention
+ FFN) runs on the compressed rows with a ``+log k`` logit bias on every averaged key, and only
the residual update is decompressed back to the tokens. That is a *stack wrapper*
(DESIGN §2, §4.1): :class:`longctx.models.vcc_stack.VCCEncoderStack` in an encoder and
:class:`longctx.models.vcc_stack.VCCDecoderStack` (VCC-LM, our causal extension, §4.2) in a
decoder. The backbone builds it in place of its plain block loop whenever ``model.attention.name``
names this method (capability :meth:`AttentionCore.stack_wrapper`), over the same blocks and
parameter tree (a dense checkpoint loads unchanged).

This file holds the method's config, its validation, and the core every wrapped block carries:
softmax attention over the rows the encoder wrapper hands it, with the wrapper's additive per-key
bias (``log D`` + the straight-through gate, ``-1e9`` on masked rows). The core never runs on its
own: called without ``key_bias`` (i.e. by a plain block loop, which would be exact attention in
place of VCC) it raises. Its contract cases therefore run at the model level (``level='model'``,
tests/models/test_model_contract.py).

Departures from the paper / reference code are listed in ``longctx/models/vcc_stack.py``'s
docstring (selection score form, two resolutions only, max(count, 1) means, masked-coarse layout,
Python loop instead of scan; VCC-LM's state layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from longctx.attention.base import AttentionCore, ContractCase, check_qkv, require

NEG = -1e9  # masked keys: exp underflows to exactly 0 in fp32 (§8.13)


def biased_attention(q, k, v, key_bias, *, query_chunk: int = 0):
    """Softmax attention with an additive per-key logit bias, fp32 softmax.

    q, k: [B, H, R, D]; v: [B, H, R, Dv]; key_bias: [B, R] (added to every query's logits; -1e9
    masks a key). ``query_chunk`` > 0 runs query chunks of that size under ``lax.map`` (each
    rematerialized) so the [R, R] logits are never held whole."""
    B, H, R, D = q.shape
    scale = D**-0.5
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    bias = key_bias.astype(jnp.float32)[:, None, None, :]

    def one(qc):
        s = jnp.einsum("bhqd,bhkd->bhqk", qc.astype(jnp.float32) * scale, kf) + bias
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", p, vf)

    if query_chunk <= 0 or R <= query_chunk:
        return one(q).astype(v.dtype)
    pad = (-R) % query_chunk
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    n = qp.shape[2] // query_chunk
    qb = qp.reshape(B, H, n, query_chunk, D).transpose(2, 0, 1, 3, 4)
    out = jax.lax.map(jax.checkpoint(one), qb)  # [n, B, H, c, Dv]
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, H, n * query_chunk, -1)[:, :, :R]
    return out.astype(v.dtype)


class VCCAttention(AttentionCore):
    """The attention of a VCC layer over the compressed rows (key-biased softmax); the compression
    itself is the stack wrapper's (``longctx/models/vcc_stack.py``)."""

    name = "vcc"
    EXECUTION_KEYS = ("query_chunk",)
    supports_causal = True  # VCC-LM (§4.2): longctx.models.vcc_stack.VCCDecoderStack
    supports_bidirectional = True

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(
            {
                "num_vip": 48,  # n_p: VIP slots (static); (row length - n_p) must be a multiple of block_size
                "block_size": 16,  # k
                "num_fine_blocks": 8,  # h: blocks refined to token resolution per layer
                "num_dense_layers": 1,  # the first layers: plain layers on segments of dense_segment_len tokens
                "dense_segment_len": 512,
                "explore_prob": 0.1,  # training: per example and layer, a random ranking of the blocks
                "scale_correction": True,  # +log k on the logits of averaged keys
                "ste_gate": True,  # straight-through gate: gives the selection logits a gradient (training)
                "levels": None,  # the L-level version (§2.10): not implemented, must stay None
                "query_chunk": 1024,  # attention over the compressed rows in query chunks (0: whole)
                # VCC-LM (decoder, §4.2): explore_prob, scale_correction, ste_gate above apply too
                "causal": ml_collections.ConfigDict({
                    "window": 512,  # w: queries sharing one selection
                    "local": 512,  # g: exact band of the g positions before the window (plus the window)
                    "block_size": 16,  # k (divides window and local)
                    "num_fine_blocks": 64,  # h: old blocks read at token resolution per window
                    "anchors": 128,  # a: the queries of the a positions before a window choose its fine blocks
                }),
            }
        )

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        p = "attention.vcc"
        require(cfg.num_vip >= 0, f"{p}.num_vip={cfg.num_vip}; must be >= 0")
        require(cfg.block_size >= 1, f"{p}.block_size={cfg.block_size}; must be >= 1")
        require(cfg.num_fine_blocks >= 1, f"{p}.num_fine_blocks={cfg.num_fine_blocks}; must be >= 1")
        require(cfg.num_dense_layers >= 0, f"{p}.num_dense_layers={cfg.num_dense_layers}; must be >= 0")
        require(cfg.dense_segment_len >= 1, f"{p}.dense_segment_len={cfg.dense_segment_len}; must be >= 1")
        require(0.0 <= cfg.explore_prob <= 1.0, f"{p}.explore_prob={cfg.explore_prob}; must be in [0, 1]")
        require(cfg.levels is None, f"{p}.levels={cfg.levels!r}: the L-level version (docs/methods/vcc.md §2.10) is not "
                "implemented; leave None (two resolutions: block_size and 1)")
        lc = cfg.causal
        require(lc.window >= 1 and lc.local >= 0 and lc.block_size >= 1 and lc.anchors >= 1,
                f"{p}.causal: window, block_size, anchors must be >= 1 and local >= 0")
        require(lc.window % lc.block_size == 0 and lc.local % lc.block_size == 0,
                f"{p}.causal.block_size={lc.block_size} must divide window={lc.window} and local={lc.local}")
        require(lc.num_fine_blocks >= 1, f"{p}.causal.num_fine_blocks={lc.num_fine_blocks}; must be >= 1")
        require(lc.anchors <= max(lc.local, lc.window),
                f"{p}.causal.anchors={lc.anchors} must be at most max(local, window)")
        require(cfg.query_chunk >= 0, f"{p}.query_chunk={cfg.query_chunk}; must be >= 0 (0 = all queries at once)")

    @classmethod
    def stack_wrapper(cls, *, causal: bool) -> str | None:
        return "longctx.models.vcc_stack:" + ("VCCDecoderStack" if causal else "VCCEncoderStack")

    @classmethod
    def bench_variants(cls):
        # the core alone is key-biased exact attention over the rows it is given; VCC's cost and
        # error live in the stack wrapper, so the core-level attention benchmark has nothing to time
        return {}

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        # rows of 40 = 8 VIP slots + 8 blocks of 4; 2 refined per layer, one segment-local dense layer
        small = {"num_vip": 8, "block_size": 4, "num_fine_blocks": 2, "num_dense_layers": 1,
                 "dense_segment_len": 16, "query_chunk": 0, "explore_prob": 0.5}
        lm = {"causal": {"window": 8, "local": 8, "block_size": 4, "num_fine_blocks": 2, "anchors": 4},
              "explore_prob": 0.5}
        return {"lm": ContractCase(cfg=lm, length=64, directions=("causal",), level="model"),
                "encoder": ContractCase(cfg=small, length=40, directions=("bidirectional",), level="model")}

    def init_state(self, batch_size: int, max_len: int | None = None):
        raise ValueError("vcc: the state lives in the stack wrapper (Backbone.init_state builds it)")

    def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None, key_bias=None):
        check_qkv(q, k, v)
        if key_bias is None:
            raise ValueError(
                "vcc: the core runs only inside its stack wrapper (longctx.models.vcc_stack.VCCEncoderStack), "
                "which hands it the compressed rows and their key bias; a plain block loop would compute exact "
                "attention in place of VCC")
        if state is not None:
            raise ValueError("vcc: a bidirectional core takes no state")
        return biased_attention(q, k, v, key_bias, query_chunk=self.cfg.query_chunk), None


__all__ = ["NEG", "VCCAttention", "biased_attention"]
