"""Encoder for masked-language modelling: the shared backbone with bidirectional blocks.

    logits, aux = model(tokens, important=None, deterministic=True, key=None)   # [B, T, V]
    h, aux = model.hidden(tokens, important=mask, positions=None, segment_ids=None)
    nll, weight, idx = model.masked_nll(h, targets, mask, num_masked)     # loss on masked tokens only

Every block is built with ``causal=False`` whatever ``model.causal`` says: each position sees the
whole row. There is no carried state (bidirectional cores take ``state=None``), so a row is one
call. ``important`` ([B, T] bool, the masked positions in MLM training) reaches the blocks as the
``important`` keyword; a block or stack wrapper that treats some tokens specially (VCC's VIP
tokens) uses it, the others never see it.

Packed rows (``data.packing='segments'``): ``positions`` and ``segment_ids`` [B, T] int32 (the batcher's) make
each document of the row its own sequence: its positions restart at 0 and a token attends to the whole of
its own document and to nothing else (bidirectional attention within the document), so a packed row's hidden
states are those of its documents run alone (where every layer's method takes segment ids,
``AttentionCore.takes_segments``; the others refuse in one line).

The mask token is one id beyond the tokenizer's vocabulary (``mlm.mask_id`` = the tokenizer's
vocabulary size; ``model.vocab_size`` = that + 1), so no text token is ever confused with it.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
from flax import nnx

from longctx.models.backbone import Backbone


class EncoderMLM(Backbone):
    def __init__(self, cfg, *, rngs: nnx.Rngs, platform: str | None = None):
        if cfg.causal:
            cfg = ml_collections.ConfigDict(cfg.to_dict())
            cfg.causal = False
        super().__init__(cfg, rngs=rngs, platform=platform)

    def hidden(self, tokens, important=None, *, deterministic: bool = True, key=None, positions=None,
               segment_ids=None):
        """Final-norm hidden states [B, T, d_model] and the blocks' aux; ``positions`` / ``segment_ids``: a packed
        row's (module docstring)."""
        h, _, aux = self.run(tokens, None, deterministic=deterministic, key=key, important=important,
                             positions=positions, segment_ids=segment_ids)
        return h, aux

    def __call__(self, tokens, important=None, *, deterministic: bool = True, key=None, positions=None,
                 segment_ids=None):
        h, aux = self.hidden(tokens, important, deterministic=deterministic, key=key, positions=positions,
                             segment_ids=segment_ids)
        return self.logits(h), aux

    @staticmethod
    def masked_positions(mask, num: int):
        """(idx [B, num], valid [B, num]): the first ``num`` masked positions of each row, in order
        (static shape; a row with fewer masked positions pads with unmasked ones, ``valid`` False)."""
        idx = jnp.argsort(~mask, axis=1, stable=True)[:, :num]
        return idx, jnp.take_along_axis(mask, idx, axis=1)

    def masked_hidden(self, h, targets, mask, num: int):
        """Hidden states and targets gathered at the masked positions: (h [B, num, d], targets, valid, idx)."""
        idx, valid = self.masked_positions(mask, num)
        hg = jnp.take_along_axis(h, idx[..., None], axis=1)
        return hg, jnp.take_along_axis(targets, idx, axis=1), valid, idx

    def masked_nll(self, h, targets, mask, num: int):
        """(nll [B, num] in nats, zero where not valid; valid [B, num] bool; idx [B, num]): the loss at
        the masked positions only, gathered by index so the head runs on ``num`` rows, not ``T``."""
        hg, tg, valid, idx = self.masked_hidden(h, targets, mask, num)
        return jnp.where(valid, self.nll(hg, tg), 0.0), valid, idx
