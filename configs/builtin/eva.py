"""The main job (configs/default.py: byte-level decoder on the built-in corpus, same sizes and
schedule) with every attention layer replaced by causal EVA (spec shared/specs/eva.md):
local block 128, chunks of 8 tokens (C = 32 at the 256-token training length), T5 relative
position bias inside the block, the released 'full' partition.

    longctx-train --config configs/builtin/eva.py --workdir runs/eva
"""

import importlib.util
import pathlib


def _default():
    path = pathlib.Path(__file__).resolve().parents[1] / "default.py"
    spec = importlib.util.spec_from_file_location("_longctx_default_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def get_config():
    c = _default()
    c.model.attention.name = "eva"
    e = c.model.attention.eva
    e.window_size = 128
    e.chunk_size = 8
    e.partition = "full"
    e.use_rpe = True
    return c
