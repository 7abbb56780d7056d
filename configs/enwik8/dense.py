"""enwik8, byte level, a Transformer-XL-base-sized 12-layer dense decoder.

Transformer-XL base on enwik8 (Dai et al. 2019; kimiyoung/transformer-xl
pytorch/run_enwik8_base.sh): 12 layers, d_model 512, 8 heads of 64, d_inner 2048,
dropout 0.1, train tgt_len 512 / mem_len 512, batch 22, lr 2.5e-4, 400k steps,
~41M parameters, 1.06 test bpc (eval tgt_len 80, mem_len 2100, clamp_len 820).
Here: the same widths and depth with rotary positions and no recurrence memory, so
it is evaluated with a sliding window (context 512, stride 128) instead.

    longctx-prepare --config configs/enwik8/dense.py --config.data.path=/data/enwik8.zip
    longctx-train   --config configs/enwik8/dense.py --config.data.path=/data/enwik8.zip --workdir runs/enwik8
    longctx-eval    --workdir runs/enwik8 --split test

``:tiny`` is a 2-layer decoder (d_model 128, 128-byte rows, 300 steps) that trains on a 2-core CPU in a
couple of minutes; its evaluation is limited to eval.max_tokens bytes:

    longctx-prepare --config configs/enwik8/dense.py:tiny --config.data.path=/data/enwik8.zip
    longctx-train   --config configs/enwik8/dense.py:tiny --config.data.path=/data/enwik8.zip --workdir runs/enwik8_tiny
    longctx-eval    --workdir runs/enwik8_tiny --split test --config.eval.max_tokens=100000

Metric: bits per byte over all 5,000,000 test bytes (newlines included); set
data.options.txl_compat=True to drop newlines as Transformer-XL does.

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 2 x tensor = 4, bf16, scanned layers;
see node8() below):

    longctx-train --config configs/enwik8/dense.py:node8 --config.data.path=/data/enwik8.zip --workdir runs/enwik8_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/enwik8/dense.py:node8 --dry_run
"""

from configs.base import gpu_node
from longctx.config import base_config as base

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "enwik8"
    c.data.tokenizer = "bytes"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/enwik8.zip
    if arg == "tiny":
        return tiny(c)
    if arg == "node8":
        return node8(get_config())
    c.model.d_model = 512
    c.model.num_layers = 12
    c.model.num_heads = 8
    c.model.head_dim = 64
    c.model.d_ff = 2048
    c.model.dropout = 0.1
    c.model.tie_embeddings = False
    c.train.seq_len = 512
    c.train.batch_size = 22
    c.train.steps = 400_000
    c.train.lr = 2.5e-4
    c.train.warmup_steps = 4000
    c.train.min_lr_ratio = 0.0
    c.train.eval_every = 4000
    c.train.ckpt_every = 4000
    c.eval.protocol = "sliding"
    c.eval.reset = "never"
    c.eval.context = 512
    c.eval.stride = 128
    return c


def tiny(c):
    """The 2-layer smoke run (``:tiny``), from the base config ``c`` with the data settings above."""
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 64
    c.model.d_ff = 512
    c.train.seq_len = 128
    c.train.batch_size = 8
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 30
    c.train.log_every = 25
    c.train.eval_every = 150
    c.train.eval_tokens = 8192
    c.train.ckpt_every = 150
    c.eval.reset = "never"
    c.eval.max_tokens = 65536
    return c


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch (22 rows) and rows: 22 rows split
    over at most 2 batch-parallel devices, so the mesh is data = 2 x tensor = 4 (heads, MLP and vocabulary split
    4 ways); bf16 activations over fp32 master weights, the 12 layers stacked and scanned. Shared by the
    enwik8 configs built on this one (configs/enwik8/fma.py)."""
    return gpu_node(c, data=2, tensor=4)
