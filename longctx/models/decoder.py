"""Decoder language model: embed -> blocks -> norm -> logits, with a stateful call.

    logits, state, aux = model(tokens, state=None, deterministic=True, key=None)
    state = model.init_state(batch_size, max_len)

``state`` = {'pos': int32 scalar (tokens seen), 'layers': [per-block state]}.
``aux`` = {'losses': {name: scalar summed over layers}, 'stats': [per-layer stats],
'metrics': {...}}; ``model.apply_stats(aux['stats'])`` applies non-gradient updates.

The embedding, positions, blocks, norm and output head are the shared
:class:`longctx.models.backbone.Backbone`; :func:`build_model` picks the decoder or the
encoder (:mod:`longctx.models.encoder`) by ``model.kind``.
"""

from __future__ import annotations

from flax import nnx

from longctx.models.backbone import Backbone


class DecoderLM(Backbone):
    """The backbone with blocks built per ``cfg.causal`` (True for a language model)."""

    def hidden(self, tokens, state=None, *, deterministic: bool = True, key=None):
        """Final-norm hidden states [B, T, d_model] (for heads other than the dense one)."""
        return self.run(tokens, state, deterministic=deterministic, key=key)

    def __call__(self, tokens, state=None, *, deterministic: bool = True, key=None):
        h, new_state, aux = self.hidden(tokens, state, deterministic=deterministic, key=key)
        return self.logits(h), new_state, aux


def build_model(model_cfg, *, seed: int = 0):
    """``model.kind='decoder'`` -> :class:`DecoderLM`; ``'encoder'`` -> :class:`EncoderMLM`."""
    from longctx.errors import ConfigError

    if model_cfg.kind == "decoder":
        return DecoderLM(model_cfg, rngs=nnx.Rngs(seed))
    if model_cfg.kind == "encoder":
        from longctx.models.encoder import EncoderMLM

        return EncoderMLM(model_cfg, rngs=nnx.Rngs(seed))
    raise ConfigError(f"model.kind={model_cfg.kind!r} is unknown; allowed: decoder, encoder")
