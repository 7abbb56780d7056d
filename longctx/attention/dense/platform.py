"""``cudnn`` and ``splash``: exact attention by the platform's own fused kernel, cuDNN flash attention on NVIDIA
GPUs, Pallas splash attention on TPUs (DESIGN.md §3 and §8; STYLE rule 4), two of dense's implementations
(``dispatch.select`` chooses):

Both are declared here (:data:`IMPLEMENTATIONS`): ``impl='auto'`` tries the platform's kernel first (cudnn on cuda,
splash on tpu) wherever it serves the call, then the XLA forms.

* ``'cudnn'``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (bf16/fp16; causal or
  bidirectional; optional per-row key lengths for right-padded batches).
* ``'splash'``: ``jax.experimental.pallas.ops.tpu.splash_attention`` with a causal or full mask (fp32/bf16;
  sequences padded to whole blocks, the padding masked by segment ids). On the CPU it runs in Pallas interpret
  mode (slow; for tests) when named.

Each declares ``unsupported_reasons(platform, *, dtype, head_dim, value_dim, kv_cache, ...)`` (empty:
supported). A KV-cache step (a call with a state: positions offset by the cache, the oldest slots empty) is the
one form neither kernel computes whatever the configuration (cuDNN's causal mask is aligned to the first key and
its padding to the last; splash's masks are built ahead of the call from static positions): the layer runs it by
the XLA path under every ``impl``, so a model configured for a kernel still decodes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.dispatch import Implementation

FAST_IMPLS = ("cudnn", "splash")
KERNEL_NAMES = {"cudnn": "cuDNN flash attention", "splash": "Pallas splash attention"}

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


def cudnn_head_dim_max(capability: tuple[int, int] | None) -> int:
    """cuDNN's flash-attention head-dim limit as jax checks it: 256 on Hopper (9.0) or later, else 128
    (also where no device is visible, e.g. lowering for 'cuda' from a CPU)."""
    return 256 if capability is not None and capability >= (9, 0) else 128


def cudnn_unsupported_reasons(platform: str, *, dtype, head_dim: int, value_dim: int | None = None,
                              kv_cache: bool = False, k_dtype=None, v_dtype=None,
                              capability: tuple[int, int] | None = None, **_) -> list[str]:
    """Why cuDNN flash attention cannot serve this call on ``platform`` ('cuda' | 'rocm' | 'tpu' | 'cpu').
    ``capability``: the GPU's compute capability (default: the running device's, None from a CPU)."""
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
    if head_dim % 8 or head_dim > h_max:
        out.append(f"head_dim={head_dim}: cuDNN needs a multiple of 8 <= {h_max}"
                   + ("" if h_max == 256 else " (256 on Hopper or later)"))
    if value_dim is not None and value_dim != head_dim:
        out.append(f"value_dim={value_dim} != head_dim={head_dim} (cuDNN's different-value-dim form is not wired)")
    if kv_cache:
        out.append(KV_CACHE_REASON)
    return out


def splash_unsupported_reasons(platform: str, *, dtype, head_dim: int, value_dim: int | None = None,
                               kv_cache: bool = False, k_dtype=None, v_dtype=None, **_) -> list[str]:
    """Why splash attention cannot serve this call on ``platform`` ('tpu' | 'cuda' | 'rocm' | 'cpu' |
    'interpret': the CPU's Pallas interpret mode, where only what the kernel computes is checked)."""
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
    if kv_cache:
        out.append(KV_CACHE_REASON)
    return out


# ----------------------------------------------------------------------------------------------------- cuDNN
def cudnn_attention(q, k, v, *, causal: bool, kv_lengths=None, implementation: str = "cudnn"):
    """Exact attention of q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,D] through ``jax.nn.dot_product_attention``
    (scale D**-0.5; causal: query i sees keys j <= i). ``kv_lengths`` [B] int32: row b's keys from
    ``kv_lengths[b]`` on are padding. ``implementation='xla'`` runs the same call on jax's XLA path (the CPU
    tests check this wiring against dense's naive path that way)."""
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 -- [B,H,T,D] <-> jax's [B,T,H,D]
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    out = jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal, key_value_seq_lengths=kv_lengths,
                                       implementation=implementation)
    return t(out).astype(v.dtype)


# ----------------------------------------------------------------------------------------------------- splash
SPLASH_BLOCK = 512  # query / key block of the splash kernel (sequences shorter than this take one block)
SPLASH_MIN_BLOCK = 128  # the TPU lane width: blocks are multiples of it


def splash_block(T: int, block: int = SPLASH_BLOCK) -> int:
    """The block size for a sequence of T tokens: ``block``, or T rounded up to 128 where that is smaller."""
    return min(block, -(-T // SPLASH_MIN_BLOCK) * SPLASH_MIN_BLOCK)


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, T: int, causal: bool, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one = sm.CausalMask((T, T)) if causal else sm.FullMask((T, T))
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # the mask tables are constants, also when first built inside a trace
        return sk.make_splash_mha(sm.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, interpret=interpret)


def splash_attention(q, k, v, *, causal: bool, interpret: bool = False, block: int = SPLASH_BLOCK):
    """Exact self-attention of a full pass, q, k [B,H,T,D], v [B,H,T,Dv], by the splash kernel (scale D**-0.5).
    T is padded to whole blocks; padded keys are masked by segment ids (causally they are never visible)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    B, H, T, D = q.shape
    bl = splash_block(T, block)
    Tp = -(-T // bl) * bl
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, 0))) if Tp > T else x  # noqa: E731
    qs = (q.astype(jnp.float32) * D**-0.5).astype(q.dtype)
    kernel = _splash_kernel(H, Tp, causal, bl, interpret)
    seg = None
    if Tp > T and not causal:
        ids = jnp.asarray(np.arange(Tp) >= T, jnp.int32)  # 0: a real token, 1: padding
        seg = sk.SegmentIds(q=ids, kv=ids)
    out = jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=seg))(pad(qs), pad(k), pad(v))
    return out[:, :, :T].astype(v.dtype)


# ----------------------------------------------------------------------------------------------------- declarations
def _run_cudnn(q, k, v, *_, causal: bool, **__):
    return cudnn_attention(q, k, v, causal=causal)


def _run_splash(q, k, v, *_, causal: bool, interpret: bool = False, **__):
    return splash_attention(q, k, v, causal=causal, interpret=interpret)


# 'auto' tries the platform's fused kernel first (rank 0) wherever it serves the call, long or short
IMPLEMENTATIONS = (
    Implementation("cudnn", platforms=("cuda",), reasons=cudnn_unsupported_reasons, config={"impl": "cudnn"},
                   auto={"cuda": 0}, code=_run_cudnn),
    Implementation("splash", platforms=("tpu",), kernel=True, reasons=splash_unsupported_reasons,
                   config={"impl": "splash"}, auto={"tpu": 0}, code=_run_splash),
)
# the fused kernel 'auto' takes on each platform (from the declarations)
PLATFORM_KERNEL = {plat: impl.name for impl in IMPLEMENTATIONS for plat in impl.auto}


__all__ = ["FAST_IMPLS", "IMPLEMENTATIONS", "KERNEL_NAMES", "KV_CACHE_REASON", "PLATFORM_KERNEL", "cudnn_attention", "cudnn_head_dim_max",
           "cudnn_unsupported_reasons", "splash_attention", "splash_block", "splash_unsupported_reasons"]
