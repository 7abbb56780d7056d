"""Residual blocks, chosen by ``model.block`` through a registry.

Block interface (every block type follows it)::

    block = cls(cfg, layer_index=i, rngs=rngs)      # cfg: the `model` ConfigDict
    x, state = block(x, state, positions=pos, deterministic=True, key=None, aux=aux)
    state = block.init_state(batch_size, max_len)
    block.apply_stats(stats)                         # non-gradient updates (aux.stats of this layer)
    q, k, v = block.project(x, positions)            # what the block hands its attention core

x: [B, T, d_model]; positions: [T] int32 absolute positions of x's tokens, or [B, T] per row (a packed row's
positions restart at each document); aux: a ``longctx.attention.Aux`` for this layer. A packed row also brings
``segment_ids=[B, T]`` (a keyword given only with them), which the block hands its core
(``longctx.attention.base.segment_kwargs``: a core that does not take them refuses in one line).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from longctx import attention
from longctx.attention.base import segment_kwargs
from longctx.errors import ConfigError
from longctx.models import precision
from longctx.models.layers import MLP, apply_rotary, dropout, linear, make_norm
from longctx.models.sequence_shard import call_core

# name -> "module:Class". One line per block type.
_BLOCKS: dict[str, str] = {
    "transformer": "longctx.models.blocks:TransformerBlock",
    "gau": "longctx.models.gau:GAUBlock",
}


def block_names() -> tuple[str, ...]:
    return tuple(sorted(_BLOCKS))


def get_block(name: str):
    if name not in _BLOCKS:
        raise ConfigError(f"model.block={name!r} is unknown; allowed: {', '.join(block_names())}")
    module_name, cls_name = _BLOCKS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def layer_methods(cfg) -> tuple[str, ...]:
    """The attention method of each of the ``cfg.num_layers`` layers (``cfg``: the ``model`` section).

    ``model.attention.pattern`` empty (the default): every layer
    runs ``model.attention.name``. Otherwise a tuple of method names: exactly ``num_layers`` of them, or a
    group whose length divides ``num_layers``, repeated to the depth (e.g. three layers of one efficient method, then ``'dense'``)."""
    name, L = cfg.attention.name, int(cfg.num_layers)
    pattern = tuple(cfg.attention.pattern)
    if not pattern:
        return (name,) * L
    unknown = [p for p in pattern if p not in attention.names()]
    if unknown:
        raise ConfigError(f"model.attention.pattern names unknown method {unknown[0]!r}; allowed: "
                          f"{', '.join(attention.names())}")
    if L % len(pattern):
        raise ConfigError(f"model.attention.pattern has {len(pattern)} methods, which neither equals nor divides "
                          f"model.num_layers={L}")
    return pattern * (L // len(pattern))


def layer_config(cfg, layer_index: int):
    """``cfg`` (the ``model`` section) as layer ``layer_index`` sees it: ``attention.name`` is that layer's
    method (:func:`layer_methods`). Without a pattern, ``cfg`` itself."""
    if not cfg.attention.pattern:
        return cfg
    import ml_collections

    layer_cfg = ml_collections.ConfigDict(cfg.to_dict())
    layer_cfg.attention.name = layer_methods(cfg)[layer_index]
    return layer_cfg


def takes_rotary(method: str) -> bool:
    """Whether a layer running ``method`` rotates its q and k when ``model.positions='rotary'``: every method
    whose ``allowed_positions`` admits rotary. One that does not (a core with its own position signal, e.g. a
    relative bias inside the core) runs unrotated; :func:`longctx.config.validate` accepts that only in a pattern
    where another layer's method takes the rotation (a model with no rotated layer is refused)."""
    allowed = attention.get_class(method).allowed_positions
    return allowed is None or "rotary" in allowed


def split_key(key, n: int):
    if key is None:
        return [None] * n
    return list(jax.random.split(key, n))


def kv_heads(cfg) -> int:
    """The k/v heads of a ``model`` section: ``model.num_kv_heads`` (0: ``model.num_heads``)."""
    return int(cfg.num_kv_heads or cfg.num_heads)


class TransformerBlock(nnx.Module):
    """Pre-LN block: x + Drop(Attn(LN(x))); x + Drop(MLP(LN(x))). Multi-head attention
    whose mixer is the configured attention core.

    Options of the ``model`` section it reads (each default builds the block as before the option existed):

    * ``num_kv_heads`` (grouped-query attention): the k and v projections produce ``num_kv_heads`` heads (one
      projection ``qkv`` of width ``(num_heads + 2 * num_kv_heads) * head_dim``: q's heads, then k's, then v's), and
      each k/v head is repeated to the ``num_heads // num_kv_heads`` query heads of its group (Hugging Face's
      ``repeat_kv``) before the attention core, so every method takes them unchanged (its decoding state holds the
      repeated heads);
    * ``qkv_bias``, ``out_bias``: biases on the q/k/v projection and on the output projection;
    * ``mlp``, ``mlp_bias``: the feed-forward sublayer (:class:`longctx.models.layers.MLP`);
    * ``rope_theta``: the rotary base; ``norm_eps``: the norms' epsilon;
    * ``post_norm`` (BERT, RoBERTa): the post-norm block x = LN1(x + Drop(Attn(x))); x = LN2(x + Drop(MLP(x))),
      the same parameters, ``norm1`` after the attention and ``norm2`` after the MLP.
    """

    def __init__(self, cfg, *, layer_index: int, rngs: nnx.Rngs, platform: str | None = None):
        d, H, Dh = cfg.d_model, cfg.num_heads, cfg.head_dim
        Hkv = kv_heads(cfg)
        self.num_heads, self.head_dim, self.num_kv_heads = H, Dh, Hkv
        # rotary per layer: a layer whose method takes no rotary (a pattern's other layers do) runs unrotated
        self.rotary = cfg.positions == "rotary" and takes_rotary(cfg.attention.name)
        self.rope_theta = float(cfg.rope_theta)
        self.dropout_rate = cfg.dropout
        self.post_norm = bool(cfg.post_norm)
        pol = precision.policy(cfg, platform)
        eps = float(cfg.norm_eps)
        self.norm1 = make_norm(cfg.norm, d, rngs, pol, eps=eps)
        self.norm2 = make_norm(cfg.norm, d, rngs, pol, eps=eps)
        self.qkv = linear(d, (H + 2 * Hkv) * Dh, ("embed", "qkv"), use_bias=bool(cfg.qkv_bias),
                          rngs=rngs, **pol.layer_kw, **pol.rows_kw)
        self.out = linear(H * Dh, d, ("qkv", "embed"), use_bias=bool(cfg.out_bias), rngs=rngs,
                          **pol.layer_kw, **pol.rows_kw)
        name = cfg.attention.name
        self.core = attention.build(
            name, cfg.attention.get(name), num_heads=H, head_dim=Dh, causal=cfg.causal, rngs=rngs, platform=platform,
            cache_dtype=pol.cache)
        self.mlp = MLP(d, cfg.d_ff, dropout=cfg.dropout, rngs=rngs, policy=pol, kind=str(cfg.mlp),
                       use_bias=bool(cfg.mlp_bias))

    def __call__(self, x, state, *, positions, deterministic: bool = True, key=None, aux=None, segment_ids=None):
        B, T, _ = x.shape
        k_core, k_attn, k_mlp, k_res = split_key(key, 4)
        segs = segment_kwargs(self.core, segment_ids)
        q, k, v = self.project(x, positions)
        o, state = call_core(self.core, q, k, v, state, deterministic=deterministic, key=k_core, aux=aux, **segs)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, self.num_heads * self.head_dim)
        x = x + dropout(self.out(o.astype(x.dtype)), self.dropout_rate, deterministic, k_attn)
        if self.post_norm:
            x = self.norm1(x)
            h = self.mlp(x, deterministic=deterministic, key=k_mlp)
            return self.norm2(x + dropout(h, self.dropout_rate, deterministic, k_res)), state
        h = self.mlp(self.norm2(x), deterministic=deterministic, key=k_mlp)
        x = x + dropout(h, self.dropout_rate, deterministic, k_res)
        return x, state

    def project(self, x, positions):
        """The q, k, v [B, H, T, Dh] this block hands its attention core (k and v repeated to the H query heads
        under grouped-query attention)."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        h = x if self.post_norm else self.norm1(x)
        if Hkv == H:
            qkv = self.qkv(h).reshape(B, T, 3, H, Dh).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        else:
            qkv = self.qkv(h)
            heads = lambda a, n: a.reshape(B, T, n, Dh).transpose(0, 2, 1, 3)  # noqa: E731
            q = heads(qkv[..., : H * Dh], H)
            k = heads(qkv[..., H * Dh : (H + Hkv) * Dh], Hkv)
            v = heads(qkv[..., (H + Hkv) * Dh :], Hkv)
        if self.rotary:
            q, k = apply_rotary(q, positions, self.rope_theta), apply_rotary(k, positions, self.rope_theta)
        if Hkv != H:
            k, v = jnp.repeat(k, H // Hkv, axis=1), jnp.repeat(v, H // Hkv, axis=1)
        return q, k, v

    def init_state(self, batch_size: int, max_len: int | None):
        return self.core.init_state(batch_size, max_len)

    def apply_stats(self, stats) -> None:
        self.core.apply_stats(stats)



