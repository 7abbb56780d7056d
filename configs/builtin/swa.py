"""The exact-attention baseline (configs/default.py: byte-level decoder on the built-in corpus, same context, steps and
schedule) with every attention layer looking back over a sliding window of 64 bytes (the method ``swa``, Longformer's
and Mistral's local attention): a quarter of the 256-byte rows, so the window binds. No parameters, so the dense
default's parameter count. Its decoding state is the window.

    longctx-train --config configs/builtin/swa.py --workdir runs/swa
    longctx-eval  --workdir runs/swa --split test
"""

from configs import default


def get_config():
    c = default.get_config()
    c.model.attention.name = "swa"
    c.model.attention.swa.window = 64
    return c
