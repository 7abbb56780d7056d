"""Small building blocks: norms, MLP, position encodings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longctx.attention.base import axes, logical
from longctx.layout import rows_apply


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * g (+ b), computed in fp32."""

    def __init__(self, dim: int, *, use_bias: bool = False, eps: float = 1e-6, rngs: nnx.Rngs | None = None,
                 param_dtype=jnp.float32, flat_rows: bool = False):
        self.flat_rows = flat_rows
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), **axes("norm"))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), **axes("norm")) if use_bias else None
        self.eps = eps

    def __call__(self, x):
        return rows_apply(self._rows, x, flat=self.flat_rows)

    def _rows(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def make_norm(kind: str, dim: int, rngs: nnx.Rngs, policy=None, *, eps: float = 1e-6):
    """A norm over the last axis; ``policy`` (:mod:`longctx.models.precision`): parameters in its ``param`` dtype,
    output in its compute dtype, statistics in float32 either way. ``eps`` (``model.norm_eps``): added to the
    variance (LayerNorm) or the mean square (RMSNorm)."""
    kw = {} if policy is None else {**policy.layer_kw, **policy.rows_kw}
    if kind == "layernorm":
        return LayerNorm(dim, epsilon=eps, scale_init=logical(nnx.initializers.ones, "norm"),
                         bias_init=logical(nnx.initializers.zeros, "norm"), rngs=rngs, **kw)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, **({} if policy is None else {"param_dtype": policy.param, **policy.rows_kw}))
    raise ValueError(f"unknown norm {kind!r}; allowed: layernorm, rmsnorm")


MLP_KINDS = ("gelu", "gelu_exact", "swiglu", "geglu")  # model.mlp


class MLP(nnx.Module):
    """The feed-forward sublayer, ``kind`` = ``model.mlp``:

    * ``'gelu'``: down(GELU(up(x))), GELU in its tanh form (GPT-2's ``gelu_new``);
    * ``'gelu_exact'``: the same with the exact (erf) GELU (BERT's and RoBERTa's ``gelu``);
    * ``'swiglu'``: down(SiLU(gate(x)) * up(x)) (Llama, Mistral, Qwen2);
    * ``'geglu'``: down(GELU(gate(x)) * up(x)), GELU in its tanh form (Gemma).

    ``use_bias`` (``model.mlp_bias``): biases on every projection. The gated kinds have a third projection
    ``gate``; the parameter tree of ``'gelu'`` and ``'gelu_exact'`` is ``up``, ``down`` only."""

    def __init__(self, dim: int, hidden: int, *, dropout: float, rngs: nnx.Rngs, policy=None, kind: str = "gelu",
                 use_bias: bool = True):
        if kind not in MLP_KINDS:
            raise ValueError(f"unknown mlp {kind!r}; allowed: {', '.join(MLP_KINDS)}")
        kw = {} if policy is None else {**policy.layer_kw, **policy.rows_kw}
        self.kind = kind
        if kind not in ("gelu", "gelu_exact"):
            self.gate = linear(dim, hidden, ("embed", "mlp"), use_bias=use_bias, rngs=rngs, **kw)
        self.up = linear(dim, hidden, ("embed", "mlp"), use_bias=use_bias, rngs=rngs, **kw)
        self.down = linear(hidden, dim, ("mlp", "embed"), use_bias=use_bias, rngs=rngs, **kw)
        self.dropout = dropout

    def __call__(self, x, *, deterministic: bool, key=None):
        if self.kind == "gelu":
            h = jax.nn.gelu(self.up(x))
        elif self.kind == "gelu_exact":
            h = jax.nn.gelu(self.up(x), approximate=False)
        elif self.kind == "swiglu":
            h = jax.nn.silu(self.gate(x)) * self.up(x)
        else:
            h = jax.nn.gelu(self.gate(x)) * self.up(x)
        h = dropout(h, self.dropout, deterministic, key)
        return self.down(h)


class LayerNorm(nnx.LayerNorm):
    """``nnx.LayerNorm`` applied through :func:`longctx.layout.rows_apply` (same parameters, same function);
    ``flat_rows``: the rows flattened (a CPU host's layout)."""

    def __init__(self, *args, flat_rows: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.flat_rows = flat_rows

    def __call__(self, x, *args, **kwargs):
        return rows_apply(lambda rows: super(LayerNorm, self).__call__(rows, *args, **kwargs), x, flat=self.flat_rows)


class Linear(nnx.Linear):
    """``nnx.Linear`` applied through :func:`longctx.layout.rows_apply` (same parameters, same function);
    ``flat_rows``: the rows flattened (a CPU host's layout)."""

    def __init__(self, *args, flat_rows: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.flat_rows = flat_rows

    def __call__(self, x):
        return rows_apply(super().__call__, x, flat=self.flat_rows)


def linear(d_in: int, d_out: int, names: tuple, *, use_bias: bool = True, kernel_init=None, rngs: nnx.Rngs,
           **kw) -> nnx.Linear:
    """Linear layer whose kernel [d_in, d_out] carries logical axis ``names`` (the bias: ``names[1]``)."""
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    return Linear(d_in, d_out, use_bias=use_bias, kernel_init=logical(kernel_init, *names),
                  bias_init=logical(nnx.initializers.zeros, names[1]), rngs=rngs, **kw)


class Identity(nnx.Module):
    """x itself (the backbone's final norm under ``model.post_norm``, whose blocks end in a norm)."""

    def __call__(self, x):
        return x


class HeadTransform(nnx.Module):
    """``model.head_transform``: norm(GELU(dense(h))) on the hidden states before the output projection (the
    transform of BERT's and RoBERTa's masked-LM head); ``exact``: the erf GELU, else its tanh form."""

    def __init__(self, dim: int, *, norm: str, eps: float, exact: bool, rngs: nnx.Rngs, policy=None):
        kw = {} if policy is None else {**policy.layer_kw, **policy.rows_kw}
        self.proj = linear(dim, dim, ("embed", "mlp"), rngs=rngs, **kw)
        self.norm = make_norm(norm, dim, rngs, policy, eps=eps)
        self.exact = exact

    def __call__(self, h):
        return self.norm(jax.nn.gelu(self.proj(h), approximate=not self.exact))


def dropout(x, rate: float, deterministic: bool, key):
    """Functional dropout driven by an explicit key (deterministic or rate 0: identity). Training with a rate and
    no key is refused, as every method's own randomness is: it would silently train without dropout."""
    if deterministic or rate == 0.0:
        return x
    if key is None:
        raise ValueError(f"dropout rate {rate} with deterministic=False needs a PRNG key (key=None given)")
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def sinusoidal_table(positions, dim: int, base: float = 10_000.0):
    """[..., dim] table: [sin(p w_k) | cos(p w_k)], w_k = base^(-2k/dim)."""
    half = dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dim)
    ang = positions.astype(jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def apply_rotary(x, positions, base: float = 10_000.0):
    """Rotary position embedding on [B, H, T, D] with absolute positions [T], or per row [B, T] (a packed row's
    positions restart at each document) (half-split form: the first half of each head's dimensions pairs with the
    second half, which is Hugging Face's ``rotate_half`` layout, frequencies ``base**(-2k/D)``; ``base`` =
    ``model.rope_theta``)."""
    D = x.shape[-1]
    half = D // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / D)
    ang = positions.astype(jnp.float32)[..., None] * freqs  # [T, half], or per row [B, 1, T, half]
    if positions.ndim == 2:
        ang = ang[:, None]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, xf[..., 2 * half :]], axis=-1)
    return rot.astype(x.dtype)


def normal_init(std: float):
    return nnx.initializers.normal(stddev=std)


def fan_in_init():
    return nnx.initializers.variance_scaling(1.0, "fan_in", "normal")

