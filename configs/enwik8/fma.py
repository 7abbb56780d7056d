"""enwik8, byte level, the paper's FMA language model (Kang, Tran, De Sterck 2023, Table 1;
docs/methods/fma.md §3, §7): a 6-layer pre-LN decoder, d_model 768, 12 heads of 64, learned absolute
positions, causal FMA with p = 4 and levels = log2(n/m):

    get_config()              n = 1024, m = 64, 4 levels  (Table 1: 1.256 test bpc)
    get_config("n512")        n = 512,  m = 64, 3 levels  (1.353)
    get_config("n2048")       n = 2048, m = 128, 4 levels (1.220)
    get_config("linear")      FMA-linear (lagged, leak-free) at n = 1024 (paper: 1.298 with its leaky form)
    get_config("tiny")        a CPU smoke run: configs/enwik8/dense.py:tiny with FMA attention
                              (m = 16, p = 4, n = 128: 3 levels, groups of 16 and 32)

The paper does not report optimizer, schedule, batch size, steps or dropout (docs/methods/fma.md §3); these follow the
framework's enwik8 recipe (configs/enwik8/dense.py), identical across attention methods.

    longctx-prepare --config configs/enwik8/fma.py --config.data.path=/data/enwik8.zip
    longctx-train   --config configs/enwik8/fma.py --config.data.path=/data/enwik8.zip --workdir runs/enwik8_fma
    longctx-eval    --workdir runs/enwik8_fma --split test
    longctx-train   --config configs/enwik8/fma.py:n512 --config.data.path=/data/enwik8.zip --workdir runs/enwik8_fma512
    longctx-train   --config configs/enwik8/fma.py:tiny --config.data.path=/data/enwik8.zip --workdir runs/enwik8_fma_tiny
    longctx-eval    --workdir runs/enwik8_fma_tiny --split test --config.eval.max_tokens=100000

One node of 8 GPUs of 80 GB (``:node8``, the recipe's batch and rows: data = 2 x tensor = 4, bf16, scanned
layers; configs/enwik8/dense.py node8()):

    longctx-train --config configs/enwik8/fma.py:node8 --config.data.path=/data/enwik8.zip --workdir runs/enwik8_fma_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/enwik8/fma.py:node8 --dry_run
"""

from configs.enwik8 import dense

VARIANTS = ("n512", "n1024", "n2048", "linear", "tiny", "node8")
SIZES = {"": (1024, 64), "n1024": (1024, 64), "n512": (512, 64), "n2048": (2048, 128)}


def get_config(arg: str | None = None):
    if arg == "tiny":
        c = dense.get_config("tiny")
        c.model.attention.name = "fma"
        f = c.model.attention.fma
        f.m = 16
        f.p = 4
        f.max_len = c.train.seq_len
        f.allow_truncated_window = True  # sampling past the training length
        return c
    if arg == "node8":
        return dense.node8(get_config())
    c = dense.get_config()
    arg = arg or ""
    linear = arg == "linear"
    n, m = SIZES["" if linear else arg]
    c.model.d_model = 768
    c.model.num_layers = 6
    c.model.num_heads = 12
    c.model.head_dim = 64
    c.model.d_ff = 4 * 768
    c.model.positions = "learned"
    c.model.max_len = n
    c.train.seq_len = n
    name = "fma_linear" if linear else "fma"
    c.model.attention.name = name
    f = c.model.attention[name]
    f.m = m
    f.p = 4
    f.max_len = n
    # evaluation: sliding windows of the training length (the levels are built for n tokens)
    c.eval.protocol = "sliding"
    c.eval.context = n
    c.eval.stride = n // 4
    return c
