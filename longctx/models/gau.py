"""Gated attention unit (GAU) block: the Transformer-VQ paper's sublayer (its method page, docs/methods/, §2.1).

One GAU is one residual unit; the paper's "layer" is two GAUs and has no MLP, so for a GAU model
``model.num_layers`` counts GAUs (the paper's 24 layers = ``num_layers=48``)::

    x~ = RMSNorm(x) * g + b                      (g=1, b=0 at init; fp32 then cast back)
    Q  = tau^-1/2 RMSNorm(x~ W_Q)                [B, T, H, Dk]   (no gain/bias; tau = sqrt(Dk))
    K  = tau^-1/2 RMSNorm(x~ W_K)                [B, T, H, Dk]   (pre-quantization: the core does STVQ)
    V  = SiLU(x~ W_V)  [B, T, H, Dv]             G = SiLU(x~ W_G)  [B, T, H*Dv]
    O  = core(Q, K, V) * G
    x  + LayerDrop(Dropout(O W_O))

W_K, W_V, W_G are one fused Dense of width H*(Dk + 2*Dv); all Dense layers have no bias and
N(0, 1/fan_in) kernels. Model-config keys read here (with defaults):
``gau_expansion`` (2.0: H*Dv = gau_expansion * d_model) and ``gau_layerdrop`` (0.0: per-example
probability of dropping the residual branch; kept branches scaled by 1/(1-p)). ``model.dropout`` is the
residual dropout. Positions live inside the attention core (Transformer-XL bias), so ``positions`` is unused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from longctx import attention
from longctx.attention.base import segment_kwargs
from longctx.errors import ConfigError
from longctx.layout import rows_apply
from longctx.models import precision
from longctx.models.layers import RMSNorm, dropout, fan_in_init, linear
from longctx.models.sequence_shard import call_core


def _split_key(key, n):
    return [None] * n if key is None else list(jax.random.split(key, n))


class GAUBlock(nnx.Module):
    def __init__(self, cfg, *, layer_index: int, rngs: nnx.Rngs, platform: str | None = None):
        d, H, Dk = cfg.d_model, cfg.num_heads, cfg.head_dim
        expansion = float(cfg.gau_expansion)
        dv_total = int(round(expansion * d))
        if dv_total <= 0 or dv_total % H != 0 or abs(dv_total - expansion * d) > 1e-6:
            raise ConfigError(
                f"model.gau_expansion={expansion}: gau_expansion * d_model ({expansion * d}) must be a positive "
                f"integer divisible by num_heads={H}"
            )
        Dv = dv_total // H
        self.num_heads, self.head_dim, self.value_dim = H, Dk, Dv
        self.dropout_rate = float(cfg.dropout)
        self.layerdrop = float(cfg.gau_layerdrop)
        if not 0.0 <= self.layerdrop < 1.0:
            raise ConfigError(f"model.gau_layerdrop={self.layerdrop}; allowed: 0 <= p < 1")
        pol = precision.policy(cfg, platform)
        self.flat_rows = pol.flat_rows
        self.norm = RMSNorm(d, use_bias=True, param_dtype=pol.param, flat_rows=pol.flat_rows)
        init = fan_in_init()
        kw = {**pol.layer_kw, **pol.rows_kw}
        self.wq = linear(d, H * Dk, ("embed", "qkv"), use_bias=False, kernel_init=init, rngs=rngs, **kw)
        self.wkvg = linear(d, H * (Dk + 2 * Dv), ("embed", "qkv"), use_bias=False, kernel_init=init, rngs=rngs, **kw)
        self.wo = linear(H * Dv, d, ("qkv", "embed"), use_bias=False, kernel_init=init, rngs=rngs, **kw)
        name = cfg.attention.name
        core_cls = attention.get_class(name)
        core_cfg = attention.default_config(name)
        if cfg.attention.get(name) is not None:
            core_cfg.update(cfg.attention.get(name))
        # the GAU RMS-normalizes and scales q and k itself (§2.1); the core adapts through its capability
        core_cfg = core_cls.configure_for_block(core_cfg, normalizes_qk=True, d_model=d)
        self.core = attention.build(name, core_cfg, num_heads=H, head_dim=Dk, value_dim=Dv,
                                    causal=cfg.causal, rngs=rngs, platform=platform, cache_dtype=pol.cache)
        self._core_takes_mask = bool(core_cls.takes_token_mask)

    def __call__(self, x, state, *, positions=None, deterministic: bool = True, key=None, aux=None, mask=None,
                 segment_ids=None):
        """mask: optional [B, T] bool of tokens that count in the VQ commit loss / codebook statistics.
        segment_ids: optional [B, T] int32 of a packed row, handed to the core (``segment_kwargs``)."""
        B, T, _ = x.shape
        H, Dv = self.num_heads, self.value_dim
        k_core, k_res, k_ld = _split_key(key, 3)
        segs = segment_kwargs(self.core, segment_ids)
        q, k, v, g = self._project(x)
        extra = {"mask": mask} if (self._core_takes_mask and mask is not None) else {}
        extra.update(segs)
        o, state = call_core(self.core, q, k, v, state, deterministic=deterministic, key=k_core, aux=aux, **extra)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, H * Dv).astype(x.dtype) * g
        y = dropout(self.wo(o), self.dropout_rate, deterministic, k_res)
        if not deterministic and self.layerdrop > 0.0 and k_ld is not None:
            keep = jax.random.bernoulli(k_ld, 1.0 - self.layerdrop, (B, 1, 1))
            y = jnp.where(keep, y / (1.0 - self.layerdrop), 0.0).astype(y.dtype)
        return x + y, state

    def _project(self, x):
        B, T, _ = x.shape
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_dim
        h = self.norm(x)
        q = self.wq(h).reshape(B, T, H, Dk)
        kvg = self.wkvg(h)
        k = kvg[..., : H * Dk].reshape(B, T, H, Dk)
        v = jax.nn.silu(kvg[..., H * Dk: H * (Dk + Dv)]).reshape(B, T, H, Dv)
        g = jax.nn.silu(kvg[..., H * (Dk + Dv):])
        scale = Dk ** -0.25  # tau^-1/2, tau = sqrt(Dk)
        q = scale * _rms(q, flat=self.flat_rows)
        k = scale * _rms(k, flat=self.flat_rows)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        return q, k, v, g

    def project(self, x, positions=None):
        """The q, k, v [B, H, T, *] this block hands its attention core (for capture tools)."""
        return self._project(x)[:3]

    def init_state(self, batch_size: int, max_len: int | None = None):
        return self.core.init_state(batch_size, max_len)

    def apply_stats(self, stats) -> None:
        self.core.apply_stats(stats)


def _rms(x, eps: float = 1e-6, *, flat: bool):
    return rows_apply(functools.partial(_rms_rows, eps=eps), x, flat=flat)


def _rms_rows(x, eps: float):
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
