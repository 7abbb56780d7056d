"""Decoder language model: embed -> blocks -> norm -> logits, with a stateful call.

    logits, state, aux = model(tokens, state=None, deterministic=True, key=None, positions=None, segment_ids=None)
    state = model.init_state(batch_size, max_len)

``state`` = {'pos': int32 scalar (tokens seen), 'layers': [per-block state]} (``model.scan_layers``: one
tree of the blocks' states stacked on a leading layer axis).
``aux`` = {'losses': {name: scalar summed over layers}, 'stats': [per-layer stats],
'metrics': {...}}; ``model.apply_stats(aux['stats'])`` applies non-gradient updates.
``positions`` / ``segment_ids``: optional [B, T] int32 of packed rows (``data.packing='segments'``): each
document attended alone, its positions restarting at 0 and the carried state afresh at its first token
(:meth:`longctx.models.backbone.Backbone.run`); without them the call is the plain one.

The embedding, positions, blocks, norm and output head are the shared
:class:`longctx.models.backbone.Backbone`; :func:`build_model` picks the decoder or the
encoder (:mod:`longctx.models.encoder`) by ``model.kind``.
"""

from __future__ import annotations

from flax import nnx

from longctx.errors import ConfigError
from longctx.models.backbone import Backbone
from longctx.models.blocks import layer_methods
from longctx.models.encoder import EncoderMLM


class DecoderLM(Backbone):
    """The backbone with blocks built per ``cfg.causal`` (True for a language model)."""

    def hidden(self, tokens, state=None, *, deterministic: bool = True, key=None, positions=None, segment_ids=None):
        """(final-norm hidden states [B, T, d_model], new state, aux) (for heads other than the dense one);
        ``positions`` / ``segment_ids``: a packed row's (module docstring)."""
        return self.run(tokens, state, deterministic=deterministic, key=key, positions=positions,
                        segment_ids=segment_ids)

    def __call__(self, tokens, state=None, *, deterministic: bool = True, key=None, positions=None,
                 segment_ids=None):
        h, new_state, aux = self.hidden(tokens, state, deterministic=deterministic, key=key, positions=positions,
                                        segment_ids=segment_ids)
        return self.logits(h), new_state, aux


def with_execution(model_cfg, execution):
    """``model_cfg`` whose attention method section also holds its execution settings (``execution``: the
    config's ``execution`` section): what the blocks hand ``attention.build``. Keys already under the method
    section win. ``execution=None``: ``model_cfg`` itself (the method's default execution settings apply)."""
    import ml_collections

    if execution is None:
        return model_cfg
    merged = None
    for name in dict.fromkeys((model_cfg.attention.name, *layer_methods(model_cfg))):  # a pattern: each method's
        settings = execution.get("attention", {}).get(name) if hasattr(execution, "get") else None
        if not settings:
            continue
        merged = ml_collections.ConfigDict(model_cfg.to_dict()) if merged is None else merged
        section = ml_collections.ConfigDict(settings.to_dict() if hasattr(settings, "to_dict") else dict(settings))
        if merged.attention.get(name) is not None:
            section.update(merged.attention[name])
        merged.attention[name] = section
    return model_cfg if merged is None else merged


def build_model(model_cfg, *, seed: int = 0, execution=None, platform: str | None = None):
    """``model.kind='decoder'`` -> :class:`DecoderLM`; ``'encoder'`` -> :class:`EncoderMLM`. ``model_cfg``: the
    config's ``model`` section, or the whole config (its ``execution`` section then applies); ``execution``:
    the config's ``execution`` section (how the attention cores compute; default: each method's defaults);
    ``platform``: where the model runs (its row layout and its cores' implementations; None: the default
    backend)."""

    if "model" in model_cfg and "kind" not in model_cfg:  # the whole config
        execution = model_cfg.get("execution") if execution is None else execution
        model_cfg = model_cfg.model
    model_cfg = with_execution(model_cfg, execution)

    if model_cfg.kind == "decoder":
        return DecoderLM(model_cfg, rngs=nnx.Rngs(seed), platform=platform)
    if model_cfg.kind == "encoder":
        return EncoderMLM(model_cfg, rngs=nnx.Rngs(seed), platform=platform)
    raise ConfigError(f"model.kind={model_cfg.kind!r} is unknown; allowed: decoder, encoder")
