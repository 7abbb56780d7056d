"""Attention registry: the only place that knows every method's name.

    from longctx import attention
    attention.names()
    cfg = attention.default_config("dense")
    core = attention.build("dense", cfg, num_heads=4, head_dim=64, causal=True, rngs=nnx.Rngs(0))
    out, state = core(q, k, v, state=None)

Adding a method: one file in this package defining an ``AttentionCore`` subclass,
plus one line in ``_METHODS`` below.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.attention import dispatch
from longctx.attention.base import AttentionCore, Aux, NonGradState, check_qkv, require
from longctx.errors import ConfigError

# name -> "module:ClassName". One line per method.
_METHODS: dict[str, str] = {
    "dense": "longctx.attention.dense:DenseAttention",
    "swa": "longctx.attention.dense:SlidingWindowAttention",
    "transformer_vq": "longctx.attention.transformer_vq:TransformerVQAttention",
    "eva": "longctx.attention.eva:EVAAttention",
    "fma": "longctx.attention.fma:FMAAttention",
    "fma_linear": "longctx.attention.fma:FMALinearAttention",
    "kdeformer": "longctx.attention.kdeformer:KDEformerAttention",
    "vcc": "longctx.attention.vcc:VCCAttention",
}

_loaded: dict[str, type[AttentionCore]] = {}


def register(name: str, target: str) -> None:
    """Register a method defined outside this package (``"pkg.module:Class"``)."""
    _METHODS[name] = target
    _loaded.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(sorted(_METHODS))


def get_class(name: str) -> type[AttentionCore]:
    if name not in _METHODS:
        raise ConfigError(f"unknown attention method {name!r}; allowed: {', '.join(names())}")
    if name not in _loaded:
        module_name, cls_name = _METHODS[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module_name), cls_name)
    return _loaded[name]


def default_config(name: str) -> ml_collections.ConfigDict:
    """Every key of the method: hyperparameters and execution settings (what ``build`` takes)."""
    return get_class(name).default_config()


def model_config(name: str) -> ml_collections.ConfigDict:
    """The method's hyperparameters (``model.attention.<name>`` of the config)."""
    return get_class(name).model_config()


def execution_config(name: str) -> ml_collections.ConfigDict:
    """The method's execution settings (``execution.attention.<name>`` of the config)."""
    return get_class(name).execution_config()


def execution_keys(name: str) -> tuple[str, ...]:
    return tuple(get_class(name).EXECUTION_KEYS)


def validate(name: str, cfg: ml_collections.ConfigDict, *, causal: bool, prefix: str = "attention") -> None:
    """Validate a method config: unknown keys, wrong types and bad values raise ConfigError."""
    cls = get_class(name)
    if causal and not cls.supports_causal:
        raise ConfigError(f"{prefix}: method {name!r} has no causal form; use it in an encoder (model.causal=False)")
    if not causal and not cls.supports_bidirectional:
        raise ConfigError(f"{prefix}: method {name!r} has no bidirectional form; use it in a decoder (model.causal=True)")
    defaults = cls.default_config()
    _check_keys(defaults, cfg, prefix)
    cls.validate_config(cfg, causal=causal)


def _check_keys(defaults: ml_collections.ConfigDict, cfg: ml_collections.ConfigDict, prefix: str) -> None:
    for key in cfg.keys():
        if key not in defaults:
            allowed = ", ".join(sorted(defaults.keys())) or "(none)"
            raise ConfigError(f"{prefix}.{key}: unknown key; allowed keys: {allowed}")
        want, got = defaults[key], cfg[key]
        if isinstance(want, ml_collections.ConfigDict):
            _check_keys(want, got, f"{prefix}.{key}")
        elif want is not None and got is not None and not _same_kind(want, got):
            raise ConfigError(
                f"{prefix}.{key}: expected {type(want).__name__}, got {type(got).__name__} ({got!r})"
            )


def _same_kind(want, got) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool)
    if isinstance(want, float):
        return isinstance(got, (int, float))
    if isinstance(want, (tuple, list)):  # JSON round trips turn tuples into lists
        return isinstance(got, (tuple, list))
    return isinstance(got, type(want))


def build(
    name: str,
    cfg: ml_collections.ConfigDict | None = None,
    *,
    num_heads: int,
    head_dim: int,
    causal: bool,
    rngs: nnx.Rngs,
    value_dim: int | None = None,
    execution: ml_collections.ConfigDict | dict | None = None,
    platform: str | None = None,
    cache_dtype=None,
) -> AttentionCore:
    """The core of method ``name``: its defaults, then ``execution`` (settings of ``execution.attention.<name>``),
    then ``cfg`` (hyperparameters; execution keys given here too win), validated as one config. ``platform``: where
    it runs, what its implementations are selected for (default: jax's default backend). ``cache_dtype``: the dtype
    its state keeps keys and values in (``AttentionCore.cache_dtype``; a model's blocks give their compute dtype;
    None: float32)."""
    cls = get_class(name)
    merged = cls.default_config()
    if execution is not None:
        merged.update(execution)
    if cfg is not None:
        merged.update(cfg)
    validate(name, merged, causal=causal)
    core = cls(merged, num_heads=num_heads, head_dim=head_dim, causal=causal, rngs=rngs, value_dim=value_dim,
               platform=platform)
    if cache_dtype is not None:
        core.cache_dtype = jnp.dtype(cache_dtype)
    return core


def methods_of(model_cfg) -> tuple[str, ...]:
    """The attention methods a model's layers use: its ``attention.pattern``'s, else ``attention.name``."""
    pattern = tuple(model_cfg.attention.pattern)
    return tuple(dict.fromkeys(pattern)) if pattern else (model_cfg.attention.name,)


def check_execution(cfg, platform: str) -> None:
    """Before any work on ``platform`` (``cfg``: a validated config): an implementation named explicitly
    (``execution.attention.<m>.impl``) for a method the model uses, none of whose names can run on this platform,
    is refused in one line (ConfigError). What a named implementation refuses for the call's shapes is its own to
    say when the call is made; a setting for a method no layer runs is named by the config's validation."""

    used = methods_of(cfg.model)
    for name in used:
        impl = cfg.execution.attention[name].impl if name in cfg.execution.attention else "auto"
        names = dispatch.parse_impl(impl)
        if names == ("auto",):
            continue
        cls = get_class(name)
        table = {i.name: i for causal in (True, False) for i in cls.implementations(causal=causal)}
        why = []
        for n in names:
            decl = table.get(n)
            if decl is None:
                continue
            if platform in decl.platforms or (decl.kernel and platform == "cpu"):
                why = []
                break
            why.append(f"{n} runs on {', '.join(decl.platforms)}")
        if why:
            serving = [n for n, d in table.items() if platform in d.platforms or (d.kernel and platform == "cpu")]
            raise ConfigError(f"execution.attention.{name}.impl={impl!r} cannot run on {platform} ({'; '.join(why)}); "
                              f"use 'auto' or one of: {', '.join(serving)}")


__all__ = [
    "AttentionCore",
    "check_execution",
    "methods_of",
    "Aux",
    "NonGradState",
    "build",
    "check_qkv",
    "default_config",
    "execution_config",
    "execution_keys",
    "get_class",
    "model_config",
    "names",
    "register",
    "require",
    "validate",
]
