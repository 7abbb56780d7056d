"""PG-19, SentencePiece BPE 32k (trained on the train split), a 12-layer dense decoder.

Reference points: Rae et al. 2020 (Compressive Transformer, 36 layers, d_model 1024,
seq 512 + memories, 33.6 test word-level ppl) and Transformer-VQ (1.3B parameters, T=8192,
26.6). This config is a mid-size dense baseline: 12 layers, d_model 768, 12 heads of 64,
d_ff 3072, sequences of 2048 tokens (each inside one book).

    longctx-prepare --config configs/pg19/dense.py --config.data.path=/data/pg19
    longctx-train   --config configs/pg19/dense.py --config.data.path=/data/pg19 --workdir runs/pg19
    longctx-eval    --workdir runs/pg19 --split test

Metric: word-level perplexity exp(total NLL / 6,966,499) on test (3,007,061 on valid),
the official constants; one EOS per book is part of the scored stream; books reset state.

``:tiny`` is a 2-layer decoder for a CPU smoke run (a couple of minutes once the data are prepared).
Its tokenizer (4,096 pieces) is trained once on the first data.options.spm_max_chars characters of
train (10^6, so preparing stays quick; the full config uses the standard 10^9):

    longctx-prepare --config configs/pg19/dense.py:tiny --config.data.path=/data/pg19
    longctx-train   --config configs/pg19/dense.py:tiny --config.data.path=/data/pg19 --workdir runs/pg19_tiny
    longctx-eval    --workdir runs/pg19_tiny --split valid --config.eval.max_tokens=32768

On a max_tokens-limited evaluation the word-level perplexity is not comparable: it divides a
partial NLL by all words.

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 8, bf16, scanned layers, remat nothing_saveable, loss_chunk 8000;
see node8() below):

    longctx-train --config configs/pg19/dense.py:node8 --config.data.path=/data/pg19 --workdir runs/pg19_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/pg19/dense.py:node8 --dry_run
"""

from configs.base import gpu_node
from longctx.config import base_config as base

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "pg19"
    c.data.tokenizer = "sentencepiece"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/deepmind-gutenberg
    if arg == "tiny":
        return tiny(c)
    if arg == "node8":
        return node8(get_config())
    c.data.options.vocab_size = 32000
    c.model.d_model = 768
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.head_dim = 64
    c.model.d_ff = 3072
    c.model.dropout = 0.1
    c.train.seq_len = 2048
    c.train.batch_size = 32
    c.train.steps = 250_000
    c.train.lr = 3e-4
    c.train.warmup_steps = 4000
    c.train.eval_every = 5000
    c.train.ckpt_every = 5000
    c.eval.protocol = "sliding"
    c.eval.reset = "document"
    c.eval.context = 2048
    c.eval.stride = 512
    return c


def tiny(c):
    """The 2-layer smoke run (``:tiny``), from the base config ``c`` with the data settings above."""
    c.data.options.vocab_size = 4096
    c.data.options.spm_max_chars = 1_000_000
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 64
    c.model.d_ff = 512
    c.train.seq_len = 128
    c.train.batch_size = 8
    c.train.steps = 200
    c.train.lr = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    c.train.eval_tokens = 4096
    c.train.ckpt_every = 100
    c.eval.max_tokens = 32768
    return c


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch and rows: bf16 activations over
    fp32 master weights, the 12 layers stacked and scanned, each block rematerialised with nothing saved,
    data parallel over the 8 GPUs (data = 8, 4 rows per
    device; parameters and AdamW moments replicated), the 32k softmax NLL over
    vocabulary chunks (no [rows, 2048, 32000] logits)."""
    return gpu_node(c, data=8, remat_policy="nothing_saveable", loss_chunk=8000)
