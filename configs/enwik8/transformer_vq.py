"""enwik8, byte level, Transformer-VQ 190M (Lingle 2023; docs/methods/transformer_vq.md §4, paper Table 10).

48 GAUs (= 24 paper layers x 2), d_model 768, one head, Dk 128, Dv 1536 (gau_expansion 2), no MLP,
S = 512 codes, L = M = 512, T = 8192 trained in W = 2048 windows with the cache carried, batch 128,
AdamW lr 4e-4 (b2 0.98, eps 1e-9, clip 0.1, wd 2e-4), 10k warmup then cosine to 0.1, 125k updates.
Dropout: residual 0.5, sinusoid 0.2, LayerDrop 0.3 (`model.gau_layerdrop`). Head: untied Dense.
Eval resets the state every 8192-token row (the paper's protocol). Reported: 0.99 bpb test.

    longctx-train --config configs/enwik8/transformer_vq.py --config.data.path=/data/enwik8.zip --workdir runs/vq

``:tiny`` is a 4-GAU Transformer-VQ (S = L = M = 32, rows of 128 bytes in two windows of 64) that trains
on a 2-core CPU:

    longctx-train --config configs/enwik8/transformer_vq.py:tiny --config.data.path=/data/enwik8.zip --workdir runs/vq_tiny

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 8, 4 micro-batches, bf16,
scanned GAUs, remat nothing_saveable;
see node8() below):

    longctx-train --config configs/enwik8/transformer_vq.py:node8 --config.data.path=/data/enwik8.zip --workdir runs/vq_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/enwik8/transformer_vq.py:node8 --dry_run
"""

from configs.base import gpu_node
from configs.enwik8 import dense
from longctx.config import base_config as base

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    if arg == "tiny":
        return tiny()
    if arg == "node8":
        return node8(get_config())
    c = base()
    c.data.source = "enwik8"
    c.data.tokenizer = "bytes"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/enwik8.zip
    c.model.block = "gau"
    c.model.d_model = 768
    c.model.num_layers = 48  # GAUs
    c.model.num_heads = 1
    c.model.head_dim = 128
    c.model.gau_expansion = 2
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.dropout = 0.5
    c.model.gau_layerdrop = 0.3  # paper: LayerDrop 0.3 on each GAU's residual branch
    c.model.tie_embeddings = False
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 512
    vq.block_len = 512
    vq.mem_len = 0  # = block_len
    c.execution.attention.transformer_vq.reduction = "serial"
    vq.beta = 1e-4
    vq.gamma = 0.99
    vq.p_dropsin = 0.2
    c.train.seq_len = 8192
    c.train.window = 2048
    c.train.batch_size = 128
    c.train.steps = 125_000
    c.train.lr = 4e-4
    c.train.warmup_steps = 10_000
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 2e-4
    c.train.b1 = 0.9
    c.train.b2 = 0.98
    c.train.eps = 1e-9
    c.train.grad_clip = 0.1
    c.train.eval_every = 1000
    c.train.ckpt_every = 1000
    c.eval.protocol = "stream"
    c.eval.reset = "row"
    c.eval.row_len = 8192
    return c


def tiny():
    c = dense.get_config("tiny")
    c.model.block = "gau"
    c.model.num_layers = 4  # GAUs
    c.model.num_heads = 1
    c.model.head_dim = 64
    c.model.gau_expansion = 2
    c.model.norm = "rmsnorm"
    c.model.positions = "none"
    c.model.attention.name = "transformer_vq"
    vq = c.model.attention.transformer_vq
    vq.codebook_size = 32
    vq.block_len = 32
    vq.mem_len = 0
    c.train.window = 64  # seq_len 128 in two windows, cache carried
    c.eval.reset = "row"
    c.eval.row_len = 0  # = train.seq_len
    return c


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch, rows and windows as the paper:
    bf16 activations over fp32 master weights, the 48 GAUs stacked and scanned, each GAU rematerialised
    with nothing saved, data parallel over the 8 GPUs (data = 8: 184M parameters + AdamW moments, ~3 GB,
    replicated), the 128 rows of each update in 4 micro-batches (4 rows of each 2048-token window per device
    at a time). fsdp = 8 plans far worse here (110 GiB per device): with the parameters sharded on their
    d_model axis, XLA partitions the projections over that contraction axis and all-reduces whole-micro-batch
    activations ([65536, 3200] f32) instead of keeping the rows split."""
    return gpu_node(c, data=8, remat_policy="nothing_saveable", microbatches=4)
