"""Decoder language model: embed -> blocks -> norm -> logits, with a stateful call.

    logits, state, aux = model(tokens, state=None, deterministic=True, key=None)
    state = model.init_state(batch_size, max_len)

``state`` = {'pos': int32 scalar (tokens seen), 'layers': [per-block state]}.
``aux`` = {'losses': {name: scalar summed over layers}, 'stats': [per-layer stats],
'metrics': {...}}; ``model.apply_stats(aux['stats'])`` applies non-gradient updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longctx.attention import Aux
from longctx.attention.base import logical
from longctx.models.adaptive_softmax import AdaptiveSoftmax, chunked_softmax_nll
from longctx.models.blocks import get_block, split_key
from longctx.models.layers import linear, make_norm, sinusoidal_table


class DecoderLM(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg_positions = cfg.positions
        self.d_model = cfg.d_model
        self.vocab_size = cfg.vocab_size
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                               embedding_init=logical(nnx.initializers.normal(0.02), "vocab", "embed"), rngs=rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model,
                                       embedding_init=logical(nnx.initializers.normal(0.02), "position", "embed"),
                                       rngs=rngs)
            self.max_len = cfg.max_len
        else:
            self.pos_embed = None
        block_cls = get_block(cfg.block)
        self.blocks = nnx.List([block_cls(cfg, layer_index=i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = make_norm(cfg.norm, cfg.d_model, rngs)
        self.output_kind, self.loss_chunk = cfg.output, cfg.loss_chunk
        adaptive = cfg.output == "adaptive"
        self.adaptive = (
            AdaptiveSoftmax(cfg.d_model, cfg.vocab_size, tuple(cfg.adaptive_cutoffs), cfg.adaptive_div, rngs=rngs)
            if adaptive
            else None
        )
        self.head = (
            linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), use_bias=False, rngs=rngs)
            if not adaptive and not cfg.tie_embeddings
            else None
        )

    def init_state(self, batch_size: int, max_len: int | None = None):
        return {
            "pos": jnp.zeros((), jnp.int32),
            "layers": [b.init_state(batch_size, max_len) for b in self.blocks],
        }

    def embed_tokens(self, tokens, positions):
        x = self.embed(tokens)
        if self.cfg_positions == "learned":
            x = x + self.pos_embed(jnp.minimum(positions, self.max_len - 1))[None]
        elif self.cfg_positions == "sinusoidal":
            x = x + sinusoidal_table(positions, self.d_model)[None].astype(x.dtype)
        return x

    def logits(self, h):
        """[B, T, V] fp32 logits (log-probabilities for the adaptive softmax)."""
        if self.adaptive is not None:
            return self.adaptive.log_probs(h)
        if self.head is None:
            return self.embed.attend(h).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)

    def nll(self, h, targets):
        """Per-token negative log-likelihood [B, T] in nats, exact for every output kind."""
        if self.adaptive is not None:
            return self.adaptive.nll(h, targets)
        if self.loss_chunk > 0:
            W = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
            return chunked_softmax_nll(h, W, targets, chunk=self.loss_chunk)
        logp = jax.nn.log_softmax(self.logits(h), axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    def hidden(self, tokens, state=None, *, deterministic: bool = True, key=None):
        """Final-norm hidden states [B, T, d_model] (for heads other than the dense one)."""
        T = tokens.shape[1]
        pos0 = jnp.zeros((), jnp.int32) if state is None else state["pos"]
        positions = pos0 + jnp.arange(T, dtype=jnp.int32)
        x = self.embed_tokens(tokens, positions)
        layer_states = [None] * len(self.blocks) if state is None else state["layers"]
        keys = split_key(key, len(self.blocks))
        new_states, losses, stats, metrics = [], {}, [], {}
        for i, (block, st, k) in enumerate(zip(self.blocks, layer_states, keys)):
            aux = Aux()
            x, st = block(x, st, positions=positions, deterministic=deterministic, key=k, aux=aux)
            new_states.append(st)
            for name, val in aux.losses.items():
                losses[name] = losses.get(name, 0.0) + val
            stats.append(aux.stats)
            for name, val in aux.metrics.items():
                metrics[f"layer{i}/{name}"] = val
        h = self.norm(x)
        new_state = {"pos": pos0 + T, "layers": new_states}
        return h, new_state, {"losses": losses, "stats": stats, "metrics": metrics}

    def __call__(self, tokens, state=None, *, deterministic: bool = True, key=None):
        h, new_state, aux = self.hidden(tokens, state, deterministic=deterministic, key=key)
        return self.logits(h), new_state, aux

    def apply_stats(self, stats) -> None:
        for block, st in zip(self.blocks, stats):
            if st:
                block.apply_stats(st)


def build_model(model_cfg, *, seed: int = 0):
    from longctx.errors import ConfigError

    if model_cfg.kind != "decoder":
        raise ConfigError(f"model.kind={model_cfg.kind!r}: only 'decoder' is implemented")
    return DecoderLM(model_cfg, rngs=nnx.Rngs(seed))


