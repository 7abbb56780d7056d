"""WikiText-103, word level (267,735 words), a Transformer-XL-base-sized decoder.

Transformer-XL base on WT-103 (Dai et al. 2019; pytorch/run_wt103_base.sh): 16 layers,
d_model 410, 10 heads of 41, d_inner 2100, dropout 0.1, train tgt_len 150 / mem_len 150,
batch 60, lr 2.5e-4, 200k steps, adaptive softmax with cutoffs 20k/40k/200k,
~151M parameters, 24.0 test ppl (eval tgt_len 64, mem_len 640, clamp_len 400).
Here: the same sizes with rotary positions (head_dim 42, rotary needs an even width)
and no recurrence memory, so it is evaluated with a sliding window over the whole
test stream (context 512, stride 64; eval.reset='never': articles do not reset).

Output layer: the adaptive softmax (model.output='adaptive', cutoffs 20k/40k/200k, div 4),
untied from the plain input embedding (Transformer-XL ties it to an adaptive input).

    longctx-prepare --config configs/wikitext103/dense.py --config.data.path=/data/wikitext-103
    longctx-train   --config configs/wikitext103/dense.py --config.data.path=/data/wikitext-103 --workdir runs/wt103
    longctx-eval    --workdir runs/wt103 --split test

Metric: perplexity over all test tokens (words and one <eos> per line, 245,569).

``:tiny`` is a 2-layer decoder for a CPU smoke run (a few minutes; the full 267,735-word softmax
dominates the cost even at this size), reporting perplexity per token (= per word; the <eos> of
every line is a token):

    longctx-prepare --config configs/wikitext103/dense.py:tiny --config.data.path=/data/wikitext-103
    longctx-train   --config configs/wikitext103/dense.py:tiny --config.data.path=/data/wikitext-103 --workdir runs/wt103_tiny
    longctx-eval    --workdir runs/wt103_tiny --split test --config.eval.max_tokens=16384

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 4 x tensor = 2, bf16, scanned layers;
see node8() below):

    longctx-train --config configs/wikitext103/dense.py:node8 --config.data.path=/data/wikitext-103 --workdir runs/wt103_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/wikitext103/dense.py:node8 --dry_run
"""

from configs.base import gpu_node
from longctx.config import base_config as base

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "wikitext103"
    c.data.tokenizer = "words"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/wikitext-103
    if arg == "tiny":
        return tiny(c)
    if arg == "node8":
        return node8(get_config())
    c.model.d_model = 410
    c.model.num_layers = 16
    c.model.num_heads = 10
    c.model.head_dim = 42
    c.model.d_ff = 2100
    c.model.dropout = 0.1
    c.model.tie_embeddings = False  # the adaptive softmax owns its output weights
    c.model.output = "adaptive"
    c.model.adaptive_cutoffs = (20000, 40000, 200000)
    c.model.adaptive_div = 4.0
    c.train.seq_len = 150
    c.train.batch_size = 60
    c.train.steps = 200_000
    c.train.lr = 2.5e-4
    c.train.warmup_steps = 2000
    c.train.min_lr_ratio = 0.0
    c.train.eval_every = 4000
    c.train.ckpt_every = 4000
    c.eval.protocol = "sliding"
    c.eval.reset = "never"
    c.eval.context = 512
    c.eval.stride = 64
    return c


def tiny(c):
    """The 2-layer smoke run (``:tiny``), from the base config ``c`` with the data settings above."""
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 32
    c.model.d_ff = 256
    c.train.seq_len = 64
    c.train.batch_size = 4
    c.train.steps = 100
    c.train.lr = 3e-3
    c.train.warmup_steps = 10
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.eval_tokens = 2048
    c.train.ckpt_every = 50
    c.eval.reset = "never"
    c.eval.max_tokens = 16384
    c.eval.batch_size = 4
    return c


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch (60 rows) and rows: 60 rows split
    over at most 4 batch-parallel devices and d_model 410 over no more than 2, so the mesh is data = 4 x
    tensor = 2 (10 heads and the 2100-wide MLP split 2 ways; the adaptive softmax's 267,735-word vocabulary,
    odd, is not split: mesh.rules 'vocab='); bf16 activations over fp32 master weights, the 16 layers stacked
    and scanned. model.vocab_size is the corpus's fixed 267,735 words, so the plan needs no data."""
    c.model.vocab_size = 267_735
    c.mesh.rules = "vocab="
    return gpu_node(c, data=4, tensor=2)
