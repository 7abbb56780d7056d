"""Tiny causal-KDEformer decoder on the built-in corpus for a CPU smoke run (a minute or two):
configs/builtin/kdeformer.py's ``tiny`` variant (2 layers, d_model 64, 128-token context, chunks of 16).

    longctx-train --config configs/builtin/kdeformer_tiny.py --workdir runs/kdeformer_tiny
    longctx-eval  --workdir runs/kdeformer_tiny --split test
"""

from longctx.config import load_sibling


def get_config():
    return load_sibling(__file__, "kdeformer.py").get_config("tiny")
