"""Tiny VCC-LM decoder on the built-in corpus for a CPU smoke run: configs/builtin/vcc.py's ``tiny``
variant (2 layers, d_model 64, 128-byte context, windows and band of 16, blocks of 4, 2 fine).

    longctx-train --config configs/builtin/vcc_tiny.py --workdir runs/vcc_tiny
    longctx-eval  --workdir runs/vcc_tiny --split test
"""

from longctx.config import load_sibling


def get_config():
    return load_sibling(__file__, "vcc.py").get_config("tiny")
