"""The VCC core: configuration, validation, implementations, and the inputs of a call (``prepare``: the compressed
rows and their key bias; ``AttentionCore.__call__`` selects an implementation and runs it). The compression itself is
the stack wrapper's, ``longctx/attention/vcc/stack.py``.

Implementations (reference first): ``reference`` (:mod:`.reference`, the whole biased softmax at once, in float32)
and ``chunked`` (:mod:`.xla`, the same softmax in query chunks of ``query_chunk`` rows in the compute dtype, what
``impl='auto'`` takes; declared there with its per-platform ``query_chunk``).
"""

from __future__ import annotations

import functools

import ml_collections

from longctx.attention import dispatch
from longctx.attention.base import AttentionCore, ContractCase, require
from longctx.attention.vcc.reference import biased_attention

METHOD = "vcc"


class Reference(dispatch.Runner):
    """The reference: the whole key-biased softmax at once."""

    def __call__(self, core, call):
        x = call.inputs
        return dispatch.Result(biased_attention(x["q"], x["k"], x["v"], x["key_bias"]))


# named only: 'auto' takes chunked on every platform
REFERENCE = dispatch.Implementation("reference", config={"impl": "reference"}, code=Reference)


@functools.lru_cache(maxsize=None)  # the declarations are module constants: collected once
def implementations(causal: bool | None = None):
    """vcc's implementations, the reference first, then each implementation module's declarations
    (``dispatch.declared``; ``VCCAttention.implementations``)."""
    return dispatch.declared(__package__, first=(REFERENCE,), causal=causal)


def choose(impl, *, platform: str) -> dispatch.Choice:
    """The implementation of one call: ``dispatch.select`` over :func:`implementations` ('auto': chunked on every
    platform)."""
    return dispatch.select(impl, implementations(), method=METHOD, platform=platform)


def attend(q, k, v, key_bias, *, impl="auto", query_chunk: int = dispatch.PLATFORM_DEFAULT,
           platform: str):
    """Key-biased softmax attention (:func:`reference.biased_attention`) without a core: the implementation
    ``impl`` names (or 'auto' picks) on ``platform``, built with ``query_chunk`` (0: the platform's) and run
    (``dispatch.run_selected``)."""
    cfg = {"impl": impl, "query_chunk": query_chunk}
    call = dispatch.Call({"q": q, "k": k, "v": v, "key_bias": key_bias}, platform=platform)
    return dispatch.run_selected(impl, implementations(), cfg, None, call, method=METHOD).out


class VCCAttention(AttentionCore):
    """The attention of a VCC layer over the compressed rows (key-biased softmax); the compression
    itself is the stack wrapper's (``longctx/attention/vcc/stack.py``)."""

    name = "vcc"
    EXECUTION_KEYS = ("impl", "query_chunk")
    supports_causal = True  # VCC-LM (§4.2): longctx.attention.vcc.stack.VCCDecoderStack
    supports_bidirectional = True
    # packed rows: the stack wrappers lay each document out as its own row (stack.DocumentLayout, §4.3); the core
    # over one row's compressed rows never sees segment ids
    takes_segments = True

    @classmethod
    def implementations(cls, *, causal: bool = True):
        """reference (the whole biased softmax), chunked (query chunks of ``query_chunk`` rows; ``test_config``
        makes it take several chunks at test lengths). ``impl='auto'``: chunked when query_chunk > 0. Causal
        (VCC-LM): its layers compute their attention in ``longctx.attention.vcc.stack`` (one path), so one."""
        return implementations(causal=causal)

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
                # packed rows (data.packing='segments', §4.3): the most documents one row may hold; each is laid
                # out as a row of its own of the row's length (static: memory and work grow with it)
                "max_documents": 8,
                # 'reference' (all rows at once, float32) | 'chunked' | a list | 'auto' (chunked)
                "impl": "auto",
                "query_chunk": 0,  # chunked: query rows per chunk over the compressed rows (0: the platform's)
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
    def exact_len(cls, cfg, *, causal: bool) -> int:
        """VCC-LM: a window's queries read the ``local`` band before it exactly and choose ``num_fine_blocks``
        blocks of the older history at token resolution, so every window up to the first whose older history
        holds more blocks than that is exact: the first window start past ``local + num_fine_blocks *
        block_size``. The encoder: a row whose non-VIP tokens fit the fine blocks compresses nothing, within one
        segment of its plain first layers (``dense_segment_len``)."""
        if causal:
            c = cfg.causal
            return (c.local + c.num_fine_blocks * c.block_size) // c.window * c.window + c.window
        n = cfg.num_vip + cfg.num_fine_blocks * cfg.block_size
        return min(n, cfg.dense_segment_len) if cfg.num_dense_layers > 0 else n

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
        require(cfg.max_documents >= 1, f"{p}.max_documents={cfg.max_documents}; must be >= 1")
        require(cfg.query_chunk >= 0, f"{p}.query_chunk={cfg.query_chunk}; must be >= 0 (0 = the platform's default)")
        problem = dispatch.impl_problem(cfg.impl, tuple(i.name for i in implementations()))
        require(problem is None, f"{p}.{problem}")

    @classmethod
    def stack_wrapper(cls, *, causal: bool) -> str | None:
        return "longctx.attention.vcc.stack:" + ("VCCDecoderStack" if causal else "VCCEncoderStack")

    @classmethod
    def bench_variants(cls, platform: str):
        # the core alone is key-biased exact attention over the rows it is given; VCC's cost and
        # error live in the stack wrapper, so the core-level attention benchmark has nothing to time
        return {}

    @classmethod
    def contract_cases(cls) -> dict[str, ContractCase]:
        # rows of 40 = 8 VIP slots + 8 blocks of 4; 2 refined per layer, one segment-local dense layer
        small = {"num_vip": 8, "block_size": 4, "num_fine_blocks": 2, "num_dense_layers": 1,
                 "dense_segment_len": 16, "impl": "reference", "explore_prob": 0.5}
        lm = {"causal": {"window": 8, "local": 8, "block_size": 4, "num_fine_blocks": 2, "anchors": 4},
              "explore_prob": 0.5}
        # the encoder case runs the reference; "encoder_chunked" the chunked implementation over
        # its 24 compressed rows (8 VIP + 8 block means + 2 fine blocks of 4) in chunks of 16 (slow run)
        return {"lm": ContractCase(cfg=lm, length=64, directions=("causal",), level="model"),
                "encoder": ContractCase(cfg=small, length=40, directions=("bidirectional",), level="model"),
                "encoder_chunked": ContractCase(cfg={**small, "impl": "chunked", "query_chunk": 16}, length=40,
                                                directions=("bidirectional",), level="model", slow=True)}

    def init_state(self, batch_size: int, max_len: int | None = None):
        raise ValueError("vcc: the state lives in the stack wrapper (Backbone.init_state builds it)")

    def prepare(self, q, k, v, state, *, deterministic, key, key_bias=None, segment_ids=None):
        if segment_ids is not None:
            raise ValueError("vcc: segment ids go to the stack wrapper, which lays each document out as its own row; "
                             "the core over one row's compressed rows takes none")
        if key_bias is None:
            raise ValueError(
                "vcc: the core runs only inside its stack wrapper (longctx.attention.vcc.stack.VCCEncoderStack), "
                "which hands it the compressed rows and their key bias; a plain block loop would compute exact "
                "attention in place of VCC")
        if state is not None:
            raise ValueError("vcc: a bidirectional core takes no state")
        return dispatch.Call({"q": q, "k": k, "v": v, "key_bias": key_bias}), {}

    def finish(self, call, result, *, aux=None):
        return result.out, None


__all__ = ["METHOD", "REFERENCE", "VCCAttention", "attend", "choose", "implementations"]
