"""Recall benchmark (configs/recall/_common.py) with causal KDEformer (no parameters, so the dense
run's parameter count): each query sees exactly its own and the previous 64-token chunk, up to 16
most recent earlier keys with its 5-bit LSH code, and 32 uniform samples per chunk of the rest.

    longctx-train  --config configs/recall/kdeformer.py --workdir runs/recall/kdeformer
    longctx-recall --workdir runs/recall/kdeformer
"""

from configs.recall import _common

VARIANTS = ("tiny",)


def get_config(arg=None):
    c = _common.recall(arg)
    c.model.attention.name = "kdeformer"
    kc = c.model.attention.kdeformer.causal
    kc.chunk_size = 64 if arg != "tiny" else 8
    kc.local_chunks = 2
    kc.heavy_capacity = 16 if arg != "tiny" else 4
    kc.num_projs = 5 if arg != "tiny" else 3
    kc.num_samples = 32 if arg != "tiny" else 4
    kc.sampling = "uniform"
    return c
