"""Recall benchmark (configs/recall/_common.py) with a hybrid stack: layer 1 is exact (dense), layer 2
runs transformer_vq with configs/recall/transformer_vq.py's core settings (64 codes, blocks of 64 tokens, its XL
relative bias), ``model.attention.pattern = ('dense', 'transformer_vq')``.

A pattern mixes attention methods, not block types: unlike the pure transformer_vq recall run (GAU
blocks), both layers here are the recall recipe's transformer blocks (2 heads of 32, pre-norm MLP). Positions
are the recipe's rotary, applied per layer: the dense layer rotates q and k as in the dense run, the
transformer_vq layer takes no rotary (it would rotate keys before quantization) and keeps its XL relative bias
(``longctx.models.blocks.takes_rotary``). Sinusoidal positions for both layers (added to the token embeddings,
the scheme both methods accept) left this model, and a 2-layer dense one, at chance: the loss stayed at ln 16.
d_ff is trimmed so the parameter count matches the dense run's (182,016).

    longctx-train  --config configs/recall/hybrid_transformer_vq.py --workdir runs/recall/hybrid_transformer_vq
    longctx-recall --workdir runs/recall/hybrid_transformer_vq
"""

from configs.recall import _common, transformer_vq

VARIANTS = ("tiny",)

D_FF = 496


def get_config(arg=None):
    c = _common.recall(arg)  # model.positions = 'rotary' (base_config): the dense layer only
    c.model.attention.transformer_vq = transformer_vq.get_config(arg).model.attention.transformer_vq
    return _common.hybrid(c, "transformer_vq", D_FF)
