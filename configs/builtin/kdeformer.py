"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same sizes, schedule
and context, hence the same parameter count: the core has no parameters) with every attention layer
replaced by causal KDEformer (docs/methods/kdeformer.md §4). At the 256-token training length
the method's LM defaults (docs/methods/kdeformer.md §3: chunks of 128, two local chunks) would leave nothing to approximate, so
the chunks are smaller: query i sees exactly its own and the previous 32-token chunk, up to 16
most recent earlier keys with its 5-bit LSH code, and 32 uniform samples per chunk of the rest of
the prefix (importance-weighted, those already in its heavy set masked).

    longctx-train --config configs/builtin/kdeformer.py --workdir runs/kdeformer
    longctx-eval  --workdir runs/kdeformer --split test

``--config configs/builtin/kdeformer.py:tiny`` is a 2-layer smoke run (d_model 64, 128-token context,
chunks of 16).
"""

from configs import default

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = default.get_config()
    c.model.attention.name = "kdeformer"
    kc = c.model.attention.kdeformer.causal
    kc.chunk_size = 32
    kc.local_chunks = 2
    kc.heavy_capacity = 16
    kc.num_projs = 5
    kc.num_samples = 32
    kc.sampling = "uniform"
    if arg == "tiny":
        default.tiny(c)
        kc.chunk_size = 16
        kc.heavy_capacity = 8
        kc.num_projs = 4
        kc.num_samples = 16
    elif arg:
        raise ValueError(f"configs/builtin/kdeformer.py: unknown variant {arg!r}; allowed: tiny")
    return c
