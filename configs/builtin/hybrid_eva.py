"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same sizes and
schedule) as a hybrid stack: four-layer groups of three causal EVA layers (configs/builtin/eva.py's settings)
and one exact (dense) layer, repeated to the depth (one group at the baseline's 4 layers).

    longctx-train --config configs/builtin/hybrid_eva.py --workdir runs/hybrid_eva
"""

from configs.builtin import eva


def get_config():
    c = eva.get_config()
    c.model.attention.name = "eva"
    c.model.attention.pattern = ("eva", "eva", "eva", "dense")
    return c
