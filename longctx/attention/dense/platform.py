"""``cudnn`` and ``splash``: exact attention by the platform's own fused kernel, cuDNN flash attention on NVIDIA
GPUs, Pallas splash attention on TPUs (DESIGN.md §3 and §8; STYLE rule 4), two of dense's implementations
(``dispatch.select`` chooses):

Both are declared here (:data:`IMPLEMENTATIONS`): ``impl='auto'`` tries the platform's kernel first (cudnn on cuda,
splash on tpu) wherever it serves the call, then the XLA forms.

* ``'cudnn'``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (bf16/fp16; causal or
  bidirectional; optional per-row key lengths for right-padded batches). A packed row (segment ids) goes through
  cuDNN's packed ("THD") layout, which the public entry does not expose: :func:`cudnn_packed_attention`. A value
  width other than the key's (an exact layer of a GAU block) goes through cuDNN's different-value-width form (jax
  calls it MLA; Hopper, cuDNN 9.10 or later), which the public entry does not take either (it wants v shaped as
  k): jax's private entry, the values in column chunks of at most 256 (:func:`cudnn_value_chunks`).
* ``'splash'``: ``jax.experimental.pallas.ops.tpu.splash_attention`` with a causal or full mask (fp32/bf16;
  sequences padded to whole blocks, the padding masked by segment ids). On the CPU it runs in Pallas interpret
  mode (slow; for tests) when named.

Each declares ``unsupported_reasons(platform, *, dtype, head_dim, value_dim, kv_cache, ...)`` (empty:
supported). A KV-cache step (a call with a state: positions offset by the cache, the oldest slots empty) is the
one form neither kernel computes whatever the configuration (cuDNN's causal mask is aligned to the first key and
its padding to the last; splash's masks are built ahead of the call from static positions): their reasons refuse it, and the layer's
selection (``layer.choose``) follows a list that names a kernel with the XLA forms on such a call, so a model
configured for a kernel still decodes.

Under sequence parallelism (a row split over the mesh's ``sequence`` axis, :func:`sequence_mesh`) a fused kernel
is a custom call XLA's partitioner cannot split along the row, so :func:`sequence_parallel_attention` runs it in a
``shard_map`` over the whole mesh (rows over the batch axes, heads over ``tensor`` where they divide, as the
activations are): each device gathers K and V along ``sequence`` and attends its own query rows to the whole row.
The causal offset of a device's rows is where the kernels differ:

* splash: the kernel is built for the whole row with ``q_seq_shards`` = the axis size (its mask tables sharded
  along the query blocks, passed as a ``shard_map`` argument), so each device's blocks carry its own causal
  offset and fully masked blocks are skipped; each device's slice must be whole 128-token blocks.
* cuDNN: jax's cuDNN call aligns its causal mask to the first key and takes no query offset, so a causal slice
  is masked by a boolean ``mask`` [1, 1, n, T] (key j visible from row i when j <= offset + i), which jax passes
  to cuDNN as an additive bias: the kernel computes the slice's whole n x T (no causal block skipping) and its
  backward a bias gradient that is discarded; cuDNN's bias form needs an even slice length. Bidirectional
  slices need no mask.

Where a kernel refuses a split call (its ``unsupported_reasons`` with ``sequence_slice``), 'auto' takes the XLA
path, which the partitioner splits, with one log line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from longctx.attention import dispatch
from longctx.attention.base import document_starts
from longctx.attention.dense.reference import document_ids
from longctx.attention.dispatch import Implementation
from longctx.attention.row_split import SEQUENCE_AXIS, active_sequence_mesh, sequence_mesh  # noqa: F401

FAST_IMPLS = ("cudnn", "splash")
KERNEL_NAMES = {"cudnn": "cuDNN flash attention", "splash": "Pallas splash attention"}

# packed rows reach cuDNN through its packed ("THD") layout, in jax's private cuDNN entry (the public
# jax.nn.dot_product_attention takes no segment ids; a dense [T, T] boolean mask would reach cuDNN as a
# materialised bias): jax.__version__ from which it is there with unused entries handled (:func:`cudnn_packed_api`)
CUDNN_PACKED_JAX = (0, 7, 0)
# jax's own tests of the packed layout skip below this cuDNN (cudnn_get_version()'s 9.6.0)
CUDNN_PACKED_CUDNN = 90600

# a value width other than the key's (jax's "mla" branch): jax's own check asks for cuDNN 9.10 and Hopper
CUDNN_MLA_CUDNN = 91000
# cuDNN's head-dim limit on Hopper, for the value's width as for the key's (cudnn-frontend's SDPA checks: both
# <= 256 and multiples of 8); wider values are split into column chunks of at most this (:func:`cudnn_value_chunks`)
CUDNN_VALUE_CHUNK = 256
# cuDNN 9.11 and 9.12 refuse the backward of 128 < d_qk <= 192 with 64 < d_v <= 128 on Hopper except (192, 128)
# (cudnn-frontend's SDPA backward checks; fixed in 9.13)
CUDNN_MLA_BWD_GAP = (91100, 91300)

KV_CACHE_REASON = ("a KV-cache step (positions offset by the cache, empty slots) is not a full pass; the fused "
                   "kernels serve full passes only")


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def _cuda_capability() -> tuple[int, int] | None:
    """The compute capability of the first GPU where this process runs on one, else None."""
    if jax.default_backend() != "gpu":
        return None
    try:
        return tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))[:2]
    except (AttributeError, ValueError, RuntimeError):
        return None


def _cudnn_missing() -> bool:
    """jax finds no cuDNN although this process runs on a GPU (lowering from a CPU needs none)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return True
    return cuda_versions is None


def _cudnn_version() -> int | None:
    """cuDNN's version as jax reads it (e.g. 90800) where this process runs on a GPU with cuDNN, else None."""
    if jax.default_backend() != "gpu" or _cudnn_missing():
        return None
    from jax._src.lib import cuda_versions

    try:
        return int(cuda_versions.cudnn_get_version())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _jax_version() -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])


def cudnn_packed_api():
    """jax's private cuDNN entry that takes the packed layout
    (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with ``q_seqlen``/``kv_seqlen`` [B, M] and
    ``q_offsets``/``kv_offsets`` [B, M+1]), or None where this jax has none. It arrived in jax 0.5.1; before 0.7.0
    the unused entries of a row (``-1``) reached cuDNN as lengths of -1, so the packed path asks for 0.7.0 or later
    (:data:`CUDNN_PACKED_JAX`; 0.10.2 is the version this was written against)."""
    if _jax_version() < CUDNN_PACKED_JAX:
        return None
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fas
    except ImportError:
        return None
    fn = getattr(fas, "dot_product_attention", None)
    if fn is None or not {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"} <= set(inspect.signature(fn).parameters):
        return None
    return fn


def cudnn_packed_reasons(*, capability, large: bool, window: int, sequence_slice: int | None, head_dim: int = 0,
                         value_dim: int | None = None) -> list[str]:
    """Why cuDNN's packed layout cannot serve a packed row here (:func:`cudnn_packed_attention`; empty: it can)."""
    out = []
    if value_dim is not None and cudnn_head_dim(value_dim) != cudnn_head_dim(head_dim):
        out.append(f"packed rows (segment ids) with value_dim={value_dim} != head_dim={head_dim}: jax's packed layout "
                   "steps the keys' and values' offsets by the query's head width (_fix_seqlen_offsets)")
    if cudnn_packed_api() is None:
        out.append(f"packed rows (segment ids): jax {jax.__version__} has no cuDNN packed layout (jax's private "
                   "fused_attention_stablehlo.dot_product_attention with q_offsets, jax >= "
                   f"{'.'.join(map(str, CUDNN_PACKED_JAX))}); the XLA tiles serve them")
    if capability is None or capability < (9, 0):
        out.append("packed rows (segment ids): cuDNN's packed layout needs Hopper (compute capability 9.0) or later"
                   + ("" if capability is None else f", this GPU is {capability[0]}.{capability[1]}"))
    version = _cudnn_version()
    if version is not None and version < CUDNN_PACKED_CUDNN:
        out.append(f"packed rows (segment ids): cuDNN {version} < {CUDNN_PACKED_CUDNN} (the packed layout)")
    if large:
        out.append("packed rows (segment ids) past auto_threshold scores: cuDNN's packed layout runs M = T virtual "
                   "sequences per row, whose softmax statistics ([B*T, H, T] fp32) are the size of the score matrix")
    if window:
        out.append(f"packed rows (segment ids) with window={window}: cuDNN's packed layout with a sliding window is "
                   "not wired")
    if sequence_slice is not None:
        out.append("packed rows (segment ids) under sequence parallelism: the slices' documents are not wired")
    return out


def cudnn_head_dim_max(capability: tuple[int, int] | None) -> int:
    """cuDNN's flash-attention head-dim limit as jax checks it: 256 on Hopper (9.0) or later, else 128
    (also where no device is visible, e.g. lowering for 'cuda' from a CPU)."""
    return 256 if capability is not None and capability >= (9, 0) else 128


def cudnn_head_dim(head_dim: int) -> int:
    """The head dim cuDNN computes with: ``head_dim`` rounded up to a multiple of 8 (:func:`cudnn_attention` pads
    q, k and v with zero columns: the scores and the first ``head_dim`` output columns are unchanged)."""
    return -(-head_dim // 8) * 8


def cudnn_value_chunks(value_dim: int) -> tuple[int, ...]:
    """The widths of the column chunks :func:`cudnn_attention` gives cuDNN a value of ``value_dim`` columns in:
    ``value_dim`` zero-padded to a multiple of 8 (:func:`cudnn_head_dim`), split into the fewest chunks of at most
    :data:`CUDNN_VALUE_CHUNK` columns, multiples of 8 as even as can be (384: 192 + 192; 1536: six of 256).
    Attention is linear in v column by column, so each chunk's call gives its columns of the output; each call
    computes the scores and the softmax again (forward and backward), the price of the split."""
    granules = cudnn_head_dim(value_dim) // 8
    n = -(-granules * 8 // CUDNN_VALUE_CHUNK)
    return tuple(8 * (granules // n + (i < granules % n)) for i in range(n))


def cudnn_mla(head_dim: int, value_dim: int | None) -> bool:
    """Whether a call needs cuDNN's different-value-width form: a value chunk (:func:`cudnn_value_chunks`) is not
    as wide as the padded key (:func:`cudnn_head_dim`)."""
    return value_dim is not None and any(w != cudnn_head_dim(head_dim) for w in cudnn_value_chunks(value_dim))


def cudnn_mla_reasons(*, head_dim: int, value_dim: int, capability, window: int,
                      sequence_slice: int | None) -> list[str]:
    """Why cuDNN's different-value-width form cannot serve a call of ``value_dim`` != ``head_dim`` here (empty: it
    can; none where :func:`cudnn_mla` is False)."""
    if not cudnn_mla(head_dim, value_dim):
        return []
    what = f"value_dim={value_dim} != head_dim={head_dim}"
    out = []
    if capability is None or capability < (9, 0):
        out.append(f"{what}: cuDNN's different-value-width form needs Hopper (compute capability 9.0) or later"
                   + ("" if capability is None else f", this GPU is {capability[0]}.{capability[1]}"))
    version = _cudnn_version()
    if version is not None and version < CUDNN_MLA_CUDNN:
        out.append(f"{what}: cuDNN {version} < {CUDNN_MLA_CUDNN} (the different-value-width form)")
    dk = cudnn_head_dim(head_dim)
    if version is not None and CUDNN_MLA_BWD_GAP[0] <= version < CUDNN_MLA_BWD_GAP[1] and 128 < dk <= 192 and any(
            64 < w <= 128 and (dk, w) != (192, 128) for w in cudnn_value_chunks(value_dim)):
        out.append(f"{what}: cuDNN {version} has no backward for key width {dk} with value chunks "
                   f"{cudnn_value_chunks(value_dim)} (9.11 and 9.12; 9.13 has)")
    if window:
        out.append(f"{what} with window={window}: cuDNN's sliding window with a different value width is not "
                   "wired")
    if sequence_slice is not None:
        out.append(f"{what} under sequence parallelism: cuDNN's bias-masked slices with a different value width "
                   "are not wired")
    return out


def cudnn_unsupported_reasons(platform: str, *, dtype, head_dim: int, value_dim: int | None = None,
                              kv_cache: bool = False, k_dtype=None, v_dtype=None,
                              capability: tuple[int, int] | None = None, sequence_slice: int | None = None,
                              causal: bool = True, window: int = 0, segments: bool = False, large: bool = False,
                              **_) -> list[str]:
    """Why cuDNN flash attention cannot serve this call on ``platform`` ('cuda' | 'rocm' | 'tpu' | 'cpu').
    ``capability``: the GPU's compute capability (default: the running device's, None from a CPU).
    ``sequence_slice``: the tokens per device where the row is split over the mesh's ``sequence`` axis.
    ``segments``: a packed row (segment ids), served by cuDNN's packed layout where :func:`cudnn_packed_reasons`
    has none (``large``: Tq*Tk past auto_threshold)."""
    out = []
    if platform != "cuda":
        out.append(f"cuDNN runs only on NVIDIA GPUs (platform {platform})")
    elif _cudnn_missing():
        out.append("jax finds no cuDNN on this GPU machine (jax._src.lib.cuda_versions is None)")
    dts = {_dtype_name(d) for d in (dtype, k_dtype or dtype, v_dtype or dtype)}
    if len(dts) > 1:
        out.append(f"q, k, v dtypes differ ({', '.join(sorted(dts))}); cuDNN takes one dtype")
    if not dts <= {"bfloat16", "float16"}:
        out.append(f"dtype {_dtype_name(dtype)}: cuDNN flash attention takes bfloat16 or float16 inputs only")
    if platform == "cuda" and capability is None:
        capability = _cuda_capability()
    h_max = cudnn_head_dim_max(capability)
    if cudnn_head_dim(head_dim) > h_max:  # a head dim off the multiples of 8 is zero-padded to one
        out.append(f"head_dim={head_dim}: cuDNN takes head dims up to {h_max}"
                   + ("" if h_max == 256 else " (256 on Hopper or later)"))
    if value_dim is not None and not segments:
        out.extend(cudnn_mla_reasons(head_dim=head_dim, value_dim=value_dim, capability=capability, window=window,
                                     sequence_slice=sequence_slice))
    if sequence_slice is not None and causal and sequence_slice % 2:
        out.append(f"sequence parallelism: a causal slice of {sequence_slice} tokens per device; cuDNN's "
                   "bias-masked form (the slice's causal offset) needs an even slice length")
    if window and not causal:
        out.append(f"window={window} bidirectional: cuDNN's sliding window is causal only")
    if window and sequence_slice is not None:
        out.append(f"window={window} under sequence parallelism: the slices' windows are not wired")
    if segments and platform == "cuda":
        out.extend(cudnn_packed_reasons(capability=capability, large=large, window=window,
                                        sequence_slice=sequence_slice, head_dim=head_dim, value_dim=value_dim))
    if kv_cache:
        out.append(KV_CACHE_REASON)
    return out


def splash_unsupported_reasons(platform: str, *, dtype, head_dim: int, value_dim: int | None = None,
                               kv_cache: bool = False, k_dtype=None, v_dtype=None, sequence_slice: int | None = None,
                               window: int = 0, segments: bool = False, **_) -> list[str]:
    """Why splash attention cannot serve this call on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'cpu' |
    'interpret': the CPU's Pallas interpret mode, where only what the kernel computes is checked).
    ``sequence_slice``: the tokens per device where the row is split over the mesh's ``sequence`` axis.
    ``segments``: a packed row, served by the kernel's own ``SegmentIds`` (not under sequence parallelism)."""
    out = []
    if platform not in ("tpu", "interpret"):
        out.append(f"splash attention is a TPU (Mosaic) kernel (platform {platform})")
    dts = {_dtype_name(d) for d in (dtype, k_dtype or dtype, v_dtype or dtype)}
    if len(dts) > 1:
        out.append(f"q, k, v dtypes differ ({', '.join(sorted(dts))})")
    if not dts <= {"bfloat16", "float32"}:
        out.append(f"dtype {_dtype_name(dtype)}: splash attention takes float32 or bfloat16")
    if platform != "interpret":
        dims = [("head_dim", head_dim)] + ([("value_dim", value_dim)] if value_dim not in (None, head_dim) else [])
        for name, d in dims:
            if d % 128 and d != 64:
                out.append(f"{name}={d}: TPU blocks want a multiple of 128 (or 64)")
    if sequence_slice is not None and sequence_slice % SPLASH_MIN_BLOCK:
        out.append(f"sequence parallelism: a slice of {sequence_slice} tokens per device; splash's query blocks "
                   f"(multiples of {SPLASH_MIN_BLOCK}) must tile each device's slice")
    if window and sequence_slice is not None:
        out.append(f"window={window} under sequence parallelism: the slices' local masks are not wired")
    if segments and sequence_slice is not None:
        out.append("packed rows (segment ids) under sequence parallelism: the slices' segment ids are not wired")
    if kv_cache:
        out.append(KV_CACHE_REASON)
    return out


# ----------------------------------------------------------------------------------------------------- FLOPs
FLOPS_TAGS = {"fused_attention_causal": True, "fused_attention_full": False}  # jit name -> causal
WINDOW_TAG = "_window_"  # a sliding window's tag: <name>_window_<W>


def _tagged(fn, causal: bool, window: int = 0):
    """``fn(q, k, v, *rest)`` as a jit named for :func:`fused_call_flops`: a fused kernel's work is not visible in
    the jaxpr (a custom call, a Pallas call), so a FLOP count reads it from the named call's q, k, v (its first
    three inputs: ``fn`` closes over no traced value, which jit would add as inputs before them); a sliding
    window's width is in the name."""
    def call(*args):
        return fn(*args)

    name = "fused_attention_causal" if causal else "fused_attention_full"
    call.__name__ = call.__qualname__ = name + (f"{WINDOW_TAG}{window}" if window else "")
    return jax.jit(call)


def _window_pairs(T: int, window: int, causal: bool) -> int:
    """(query, key) pairs of a full pass over T tokens that a sliding window of ``window`` keeps."""
    w = min(window, T)
    one_side = w * T - w * (w - 1) // 2  # sum over queries of min(i + 1, w): the key itself and up to w - 1 before
    return one_side if causal else 2 * one_side - T


def fused_call_flops(name: str, avals) -> float | None:
    """Forward matmul FLOPs of a fused attention call tagged by :func:`_tagged` (``name``: the jit's name,
    ``avals``: its inputs, q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv] first): 2·B·H·Tq·Tk·(D + Dv), i.e.
    4·B·H·Tq·Tk·D, halved for causal (the MFU convention: the visible half; under sequence parallelism each
    device's Tq rows against the whole row average the same half); with a sliding window, the pairs it keeps in
    place of Tq·Tk. None: not a tagged call."""
    base, _, window = name.partition(WINDOW_TAG)
    if base not in FLOPS_TAGS:
        return None
    q, k, v = (a.shape for a in avals[:3])
    B, H, Tq, D = q
    if window:
        return 2.0 * B * H * _window_pairs(Tq, int(window), FLOPS_TAGS[base]) * (D + v[3])
    flops = 2.0 * B * H * Tq * k[2] * (D + v[3])
    return flops / 2 if FLOPS_TAGS[base] else flops


# ----------------------------------------------------------------------------------------------------- cuDNN
def cudnn_attention(q, k, v, *, causal: bool, kv_lengths=None, implementation: str = "cudnn", q_offset=None,
                    window: int = 0):
    """Exact attention of q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv] through ``jax.nn.dot_product_attention``
    (scale D**-0.5; causal: query i sees keys j <= i). ``kv_lengths`` [B] int32: row b's keys from
    ``kv_lengths[b]`` on are padding. ``q_offset`` (an int or a traced scalar; causal only): the queries are rows
    ``q_offset ..`` of the keys' sequence, masked by a boolean [1,1,Tq,Tk] mask (cuDNN's own causal mask is
    aligned to the first key). A head dim that is not a multiple of 8 (cuDNN's granule; e.g. WikiText-103's 410 / 10
    = 41) is zero-padded to :func:`cudnn_head_dim` with the scale of the true one: zero columns add nothing to the
    scores, the padded output columns are sliced off, and their cost is the padded dims' share of the FLOPs.
    ``implementation='xla'`` runs the same call on jax's XLA path (the CPU tests check this wiring against dense's
    naive path that way). ``window`` > 0 (causal, no ``q_offset``): cuDNN's sliding window of that many keys.

    v is zero-padded on its own to a multiple of 8 and given to cuDNN in the column chunks of
    :func:`cudnn_value_chunks` (one call each, the outputs concatenated): a chunk as wide as the padded key takes
    the public entry; any other width takes cuDNN's different-value-width form (:func:`_cudnn_mla_call`)."""
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 -- [B,H,T,D] <-> jax's [B,T,H,D]
    D, Dv = q.shape[-1], v.shape[-1]
    pad = cudnn_head_dim(D) - D
    if pad:
        q, k = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in (q, k))
    widths = cudnn_value_chunks(Dv)
    if sum(widths) > Dv:
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, sum(widths) - Dv),))
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    mask = None
    if causal and q_offset is not None:
        rows = q_offset + jnp.arange(q.shape[2], dtype=jnp.int32)
        mask = (jnp.arange(k.shape[2], dtype=jnp.int32)[None, :] <= rows[:, None])[None, None]
        causal = False
    if window and (not causal or q_offset is not None):
        raise ValueError("cudnn_attention: a sliding window is wired for causal full passes only")
    kw = dict(mask=mask, causal=causal, scale=D ** -0.5, kv_lengths=kv_lengths, window=window,
              implementation=implementation)
    outs, at = [], 0
    for w in widths:
        vc = v[..., at:at + w] if len(widths) > 1 else v
        at += w
        call = _cudnn_call if w == q.shape[-1] else _cudnn_mla_call
        outs.append(call(t(q), t(k), t(vc), **kw))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
    return t(out)[..., :Dv].astype(v.dtype)


def _cudnn_call(q, k, v, *, mask, causal: bool, scale: float, kv_lengths, window: int, implementation: str):
    """One call of the public entry, q, k, v [B,T,H,D] (v as wide as k): :func:`cudnn_attention`'s call."""
    local = (window - 1, 0) if window else None  # the key itself and window - 1 before it
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, scale=scale,
                                        key_value_seq_lengths=kv_lengths, implementation=implementation,
                                        local_window_size=local)


def _cudnn_mla_call(q, k, v, *, mask, causal: bool, scale: float, kv_lengths, window: int, implementation: str):
    """One call of cuDNN's different-value-width form, q, k [B,T,H,D], v [B,T,H,Dv] with Dv != D: jax's private
    entry (``fused_attention_stablehlo.dot_product_attention``, which takes any v width) given what the public
    entry gives it for the same arguments (mask type from the causal flag and the key lengths, the query lengths
    all Tq where key lengths are given, the window as a sliding-window length), as
    ``test_cudnn_mla_call_lowers_as_the_public_entry`` checks against the public entry's lowering.

    ``implementation='xla'`` (the CPU tests): the public XLA path, which wants v shaped as k, on q, k and v
    zero-padded to one width (zero columns of q and k add nothing to the scores; the padded output columns are
    sliced off). Not vmapped: jax's batching rules of this form reshape v to k's shape."""
    if implementation == "xla":
        W = max(q.shape[-1], v.shape[-1])
        wide = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, W - x.shape[-1]),))  # noqa: E731
        return _cudnn_call(wide(q), wide(k), wide(v), mask=mask, causal=causal, scale=scale, kv_lengths=kv_lengths,
                           window=window, implementation="xla")[..., :v.shape[-1]]
    if implementation != "cudnn":
        raise ValueError(f"cudnn_attention: implementation={implementation!r}; allowed: cudnn, xla")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as private_entry

    padding = kv_lengths is not None
    mask_type = {(True, True): MaskType.PADDING_CAUSAL, (True, False): MaskType.CAUSAL,
                 (False, True): MaskType.PADDING, (False, False): MaskType.NO_MASK}[(causal, padding)]
    q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32) if padding else None
    return private_entry(q, k, v, None, mask, q_lengths, kv_lengths, scale=scale, mask_type=mask_type,
                         sliding_window_length=window or None, qkv_layout="BTNH")


def cudnn_packed_layout(segment_ids):
    """cuDNN's packed layout of a packed row, computed from ``segment_ids`` [B, T] (traced; a document is a maximal
    run of equal ids, ``longctx.attention.base.document_starts``): ``(lengths [B, M], offsets [B, M + 1])`` int32
    with M = T, row b's documents in order (``offsets[b, m]`` the first token of its m-th document, ``lengths[b, m]``
    its token count) and -1 in every entry past its last document (jax's convention for unused entries).

    M is static and no row can hold more documents than M: a document is at least one token, so a row of T tokens
    holds at most T. No document is dropped or merged, whatever the ids (``offsets[b, M]`` is always -1)."""
    B, T = segment_ids.shape
    at = jnp.arange(T, dtype=jnp.int32)
    opens = document_starts(segment_ids.astype(jnp.int32)) == at  # each document's first token
    doc = jnp.cumsum(opens, axis=1, dtype=jnp.int32) - 1  # each token's document, 0 .. n_b - 1 <= T - 1
    count = doc[:, -1:] + 1  # [B, 1] the row's documents
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    lengths = jnp.zeros((B, T), jnp.int32).at[rows, doc].add(1)
    lengths = jnp.where(at[None, :] < count, lengths, -1)
    # a first token writes its own column; every other token writes -1 to the spare column M (never a document's)
    offsets = jnp.full((B, T + 1), -1, jnp.int32).at[rows, jnp.where(opens, doc, T)].set(jnp.where(opens, at, -1))
    return lengths, offsets


def cudnn_packed_attention(q, k, v, segment_ids, *, causal: bool):
    """Exact attention of a packed full pass, q, k, v [B,H,T,D] and ``segment_ids`` [B, T] int32 (a query sees only
    its own document's keys; causal within the document), by cuDNN's packed ("THD") layout through jax's private
    entry (:func:`cudnn_packed_api`): every document is one of cuDNN's B*M virtual sequences (M = T,
    :func:`cudnn_packed_layout`), with its own causal mask aligned to its first token. Scale D**-0.5; a head dim off
    the multiples of 8 is zero-padded as in :func:`cudnn_attention`.

    Cost of M = T (the bound no row can exceed): cuDNN's forward keeps softmax statistics of [B*M, H, T] fp32 for the
    backward (jax's abstract shape), the size of the fp32 score matrix, and launches its grid over B*M sequences,
    of which all but the row's documents are empty; hence its reasons refuse rows past ``auto_threshold`` scores."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    api = cudnn_packed_api()
    if api is None:
        raise NotImplementedError(cudnn_packed_reasons(capability=(9, 0), large=False, window=0,
                                                       sequence_slice=None)[0])
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 -- [B,H,T,D] <-> [B,T,H,D]: jax offsets packed rows by T
    D, Dv = q.shape[-1], v.shape[-1]
    if cudnn_head_dim(Dv) != cudnn_head_dim(D):  # its reasons refuse it (jax's offsets step by q's width)
        raise ValueError(f"cudnn: packed rows with value_dim={Dv} != head_dim={D} are not wired")
    pad = cudnn_head_dim(D) - D
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, cudnn_head_dim(D) - x.shape[-1]),)) for x in (q, k, v))
    lengths, offsets = cudnn_packed_layout(segment_ids)
    out = api(t(q), t(k), t(v), q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
              scale=D ** -0.5, mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, qkv_layout="BTNH")
    return t(out)[..., :Dv].astype(v.dtype)


# ----------------------------------------------------------------------------------------------------- splash
SPLASH_BLOCK = 512  # query / key block of the splash kernel (sequences shorter than this take one block)
SPLASH_MIN_BLOCK = 128  # the TPU lane width: blocks are multiples of it


def splash_block(T: int, block: int = SPLASH_BLOCK) -> int:
    """The block size for a sequence of T tokens: ``block``, or T rounded up to 128 where that is smaller."""
    return min(block, -(-T // SPLASH_MIN_BLOCK) * SPLASH_MIN_BLOCK)


def splash_slice_block(n: int, block: int = SPLASH_BLOCK) -> int:
    """The largest block <= ``block`` (a multiple of 128 halved from it) that tiles a slice of n tokens."""
    bl = block
    while bl > SPLASH_MIN_BLOCK and n % bl:
        bl //= 2
    if n % bl:
        raise ValueError(f"splash: a slice of {n} tokens is not whole {SPLASH_MIN_BLOCK}-token blocks")
    return bl


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, T: int, causal: bool, block: int, interpret: bool, head_shards: int = 1,
                   q_seq_shards: int = 1, q_len: int | None = None, window: int = 0):
    """The kernel of ``heads`` heads over a row of T keys and ``q_len`` (default T) queries; ``head_shards`` /
    ``q_seq_shards``: its mask tables split for a ``shard_map`` (``manual_sharding_spec``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (q_len or T, T)
    if window:  # the key itself and window - 1 before it (and after it, bidirectional)
        one = sm.LocalMask(shape, window_size=(window - 1, 0 if causal else window - 1), offset=0)
    else:
        one = sm.CausalMask(shape) if causal else sm.FullMask(shape)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # the mask tables are constants, also when first built inside a trace
        return sk.make_splash_mha(sm.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=head_shards,
                                  q_seq_shards=q_seq_shards, interpret=interpret)


def _splash_call(kernel, q, k, v, seg=None, rows=None):
    """The kernel over each row of q [B,H,T,D]: ``seg`` one SegmentIds for every row, or ``rows`` [B, T] int32 the
    segment ids of each row (a packed batch)."""
    D = q.shape[-1]
    qs = (q.astype(jnp.float32) * D**-0.5).astype(q.dtype)
    if rows is not None:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        return jax.vmap(lambda a, b, c, r: kernel(a, b, c, segment_ids=sk.SegmentIds(q=r, kv=r)))(qs, k, v, rows)
    return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=seg))(qs, k, v)


def splash_attention(q, k, v, *, causal: bool, interpret: bool = False, block: int = SPLASH_BLOCK, window: int = 0,
                     segment_ids=None):
    """Exact self-attention of a full pass, q, k [B,H,T,D], v [B,H,T,Dv], by the splash kernel (scale D**-0.5;
    ``window`` > 0: its local mask, a sliding window of that many keys; ``segment_ids`` [B, T] int32: a packed
    row's documents, maximal runs of equal ids, numbered (``reference.document_ids``) for the kernel's own
    ``SegmentIds``). T is padded to whole blocks; padded keys are masked
    by segment ids (causally they are never visible; a packed row's padding is a segment of its own)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    B, H, T, D = q.shape
    bl = splash_block(T, block)
    Tp = -(-T // bl) * bl

    def run(q, k, v, *rows):
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, 0))) if Tp > T else x  # noqa: E731
        seg = None
        if rows:  # the padding: one more segment, never one of the row's (every padded query sees itself)
            ids = document_ids(rows[0], rows[0])[0]  # documents are maximal runs: an id that comes back is a new one
            rows = (jnp.pad(ids, ((0, 0), (0, Tp - T)), constant_values=jnp.iinfo(jnp.int32).min),)
        elif Tp > T and not causal:
            ids = jnp.asarray(np.arange(Tp) >= T, jnp.int32)  # 0: a real token, 1: padding
            seg = sk.SegmentIds(q=ids, kv=ids)
        out = _splash_call(_splash_kernel(H, Tp, causal, bl, interpret, window=window), pad(q), pad(k), pad(v), seg,
                           *rows)
        return out[:, :, :T].astype(v.dtype)

    return _tagged(run, causal, window)(q, k, v, *(() if segment_ids is None else (segment_ids,)))


# ----------------------------------------------------------------------------------------------------- sequence parallelism
BATCH_AXES = ("data", "fsdp")  # the activations' row axes and heads axis (longctx.train.sharding)
HEADS_AXES = ("tensor",)
def _mesh_axes(mesh, names, size: int):
    """The axes of ``names`` (size > 1) in ``mesh`` as one PartitionSpec entry, or None where their product does
    not divide ``size`` (that dimension is then replicated inside the shard_map)."""
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    count = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or size % count:
        return None
    return axes[0] if len(axes) == 1 else axes


def sequence_parallel_attention(kernel: str, q, k, v, *, mesh, causal: bool, interpret: bool = False,
                                cudnn_implementation: str = "cudnn"):
    """Exact attention of a full pass, q, k [B,H,T,D], v [B,H,T,Dv], by ``kernel`` ('cudnn' | 'splash') with the
    row split over ``mesh``'s ``sequence`` axis (module docstring): a ``shard_map`` over the mesh, rows over the
    batch axes and heads over ``tensor`` where they divide; each device gathers K and V along ``sequence`` and
    attends its rows (offset ``index * T / size``) to the whole row. ``cudnn_implementation='xla'``: the same call
    on jax's XLA path (the CPU tests)."""
    B, H, T, _ = q.shape
    size = mesh.shape[SEQUENCE_AXIS]
    if T % size:
        raise ValueError(f"sequence parallelism: the row length {T} must be divisible by mesh.sequence={size}")
    n = T // size
    bspec, hspec = _mesh_axes(mesh, BATCH_AXES, B), _mesh_axes(mesh, HEADS_AXES, H)
    spec = P(bspec, hspec, SEQUENCE_AXIS, None)
    gather = lambda x: jax.lax.all_gather(x, SEQUENCE_AXIS, axis=2, tiled=True)  # noqa: E731

    if kernel == "cudnn":
        def rows(q, k, v):
            return cudnn_attention(q, k, v, causal=causal, implementation=cudnn_implementation,
                                   q_offset=jax.lax.axis_index(SEQUENCE_AXIS) * n if causal else None)

        def local(q, k, v):
            return _tagged(rows, causal)(q, gather(k), gather(v))

        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
    if kernel != "splash":
        raise ValueError(f"sequence_parallel_attention: kernel={kernel!r}; allowed: cudnn, splash")
    head_shards = 1 if hspec is None else int(np.prod([mesh.shape[a] for a in np.atleast_1d(hspec)]))
    block = splash_slice_block(n)
    if causal:  # the whole row's causal tables, each device's query blocks its own rows
        table = _splash_kernel(H, T, True, block, interpret, head_shards=head_shards, q_seq_shards=size)
        table_spec = table.manual_sharding_spec(NamedSharding(mesh, P(hspec, SEQUENCE_AXIS)))
    else:  # every device's rows see every key: one kernel of n queries (jax cannot shard a FullMask's tables)
        table = _splash_kernel(H // head_shards, T, False, block, interpret, q_len=n)
        table_spec = jax.tree.map(lambda _: P(), table)

    def local(table, q, k, v):  # table: this device's rows of the kernel's mask tables (arguments after q, k, v)
        leaves, tree = jax.tree.flatten(table)
        run = lambda q, k, v, *t: _splash_call(jax.tree.unflatten(tree, t), q, k, v).astype(v.dtype)  # noqa: E731
        return _tagged(run, causal)(q, gather(k), gather(v), *leaves)

    return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, spec, spec, spec), out_specs=spec,
                         check_vma=False)(table, q, k, v)


# ----------------------------------------------------------------------------------------------------- declarations
@dataclasses.dataclass(frozen=True)
class _Fused(dispatch.Runner):
    """A fused kernel's runner (no knobs: the kernels tile for themselves). It reads dense's ``call.inputs`` (q, k, v,
    ``causal``, ``window``, ``q_segment_ids``, and ``mesh``: the mesh whose ``sequence`` axis splits the row, or
    None); under a split row it runs :func:`sequence_parallel_attention`, else the kernel over the whole row. Its
    declaration's reasons refuse every call that is not a full pass, so the positions are arange(T)."""

    name: ClassVar[str] = ""

    def __call__(self, core, call: dispatch.Call) -> dispatch.Result:
        x = call.inputs
        if x["mesh"] is not None:
            return dispatch.Result(sequence_parallel_attention(self.name, x["q"], x["k"], x["v"], mesh=x["mesh"],
                                                               causal=x["causal"], interpret=call.interpret))
        return dispatch.Result(self.whole_row(x, interpret=call.interpret))


@dataclasses.dataclass(frozen=True)
class Cudnn(_Fused):
    name = "cudnn"

    @staticmethod
    def whole_row(x, *, interpret: bool):
        causal, window = x["causal"], x["window"]
        if x["q_segment_ids"] is not None:  # a full pass: the keys' documents are the queries'
            if window:  # its reasons refuse it; never attend past a window silently
                raise ValueError(f"cudnn: packed rows with window={window} are not wired")
            return _tagged(functools.partial(cudnn_packed_attention, causal=causal), causal)(
                x["q"], x["k"], x["v"], x["q_segment_ids"])
        return _tagged(functools.partial(cudnn_attention, causal=causal, window=window), causal, window)(
            x["q"], x["k"], x["v"])


@dataclasses.dataclass(frozen=True)
class Splash(_Fused):
    name = "splash"

    @staticmethod
    def whole_row(x, *, interpret: bool):
        return splash_attention(x["q"], x["k"], x["v"], causal=x["causal"], interpret=interpret, window=x["window"],
                                segment_ids=x["q_segment_ids"])


# 'auto' tries the platform's fused kernel first (rank 0) wherever it serves the call, long or short
IMPLEMENTATIONS = (
    Implementation("cudnn", platforms=("cuda",), reasons=cudnn_unsupported_reasons, config={"impl": "cudnn"},
                   auto={"cuda": 0}, code=Cudnn),
    Implementation("splash", platforms=("tpu",), kernel=True, reasons=splash_unsupported_reasons,
                   config={"impl": "splash"}, auto={"tpu": 0}, code=Splash),
)
# the fused kernel 'auto' takes on each platform (from the declarations)
PLATFORM_KERNEL = {plat: impl.name for impl in IMPLEMENTATIONS for plat in impl.auto}


__all__ = ["CUDNN_MLA_BWD_GAP", "CUDNN_MLA_CUDNN", "CUDNN_PACKED_CUDNN", "CUDNN_PACKED_JAX", "CUDNN_VALUE_CHUNK", "FAST_IMPLS", "Cudnn", "Splash", "FLOPS_TAGS", "IMPLEMENTATIONS", "KERNEL_NAMES", "KV_CACHE_REASON", "PLATFORM_KERNEL",
           "SEQUENCE_AXIS", "active_sequence_mesh", "cudnn_attention", "cudnn_head_dim", "cudnn_packed_api",
           "cudnn_packed_attention", "cudnn_packed_layout", "cudnn_packed_reasons", "cudnn_head_dim_max", "cudnn_mla",
           "cudnn_mla_reasons", "cudnn_unsupported_reasons", "cudnn_value_chunks",
           "fused_call_flops", "sequence_mesh", "sequence_parallel_attention", "splash_attention", "splash_block",
           "splash_slice_block", "splash_unsupported_reasons"]
