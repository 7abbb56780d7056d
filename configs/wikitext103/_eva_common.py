"""Shared settings of the EVA WikiText-103 configs (paper §5.2 / App. E.3, released main.sh;
docs/methods/eva.md §3.3). Not a config by itself (no get_config)."""

from configs.base import gpu_node
from configs.wikitext103 import dense
from longctx.config import base_config as base


def eva_wt103(num_layers: int, arg: str | None = None):
    if arg == "tiny":
        return tiny()
    if arg == "node8":
        return node8(eva_wt103(num_layers))
    c = base()
    c.data.source = "wikitext103"
    c.data.tokenizer = "words"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/wikitext-103
    # fairseq transformer_lm_wiki103: D 1024, FFN 4096, 8 heads of 128, pre-norm, dropout 0.3,
    # sinusoidal absolute positions, adaptive input/softmax (cutoffs 20000, 60000, factor 4, tied)
    c.model.d_model = 1024
    c.model.num_layers = num_layers
    c.model.num_heads = 8
    c.model.head_dim = 128
    c.model.d_ff = 4096
    c.model.dropout = 0.3
    c.model.positions = "sinusoidal"
    c.model.tie_embeddings = False  # the framework's adaptive softmax owns its output weights (paper: tied)
    c.model.output = "adaptive"
    c.model.adaptive_cutoffs = (20000, 60000)
    c.model.adaptive_div = 4.0
    # causal EVA: |E| = 128 (no overlap), P = 8 -> C = 64 at L = 512, adaptive_proj qk, shared T5 RPE
    c.model.attention.name = "eva"
    e = c.model.attention.eva
    e.window_size = 128
    e.chunk_size = 8
    e.overlap_window = False
    e.partition = "full"
    e.adaptive_proj = "qk"
    e.use_rpe = True
    e.attn_dropout = 0.1
    # 512-token samples; 286k updates of 9216 tokens x 4 GPUs x update-freq 2 = 73,728 tokens = 144 x 512
    c.train.seq_len = 512
    c.train.batch_size = 144
    c.train.steps = 286_000
    c.train.warmup_steps = 16_000
    c.train.grad_clip = 0.1
    c.train.lr = 2.5e-4  # paper: NAG lr 1.0 (momentum 0.99), cosine; longctx has AdamW only (see note below)
    c.train.min_lr_ratio = 1e-4
    c.train.eval_every = 4000
    c.train.ckpt_every = 4000
    # evaluation "context 480": each scored segment of 512 - 480 = 32 new tokens follows 480 stream tokens
    # (fairseq --context-window 480); use --config.eval.stride=256 for the "context 256" column.
    c.eval.protocol = "sliding"
    c.eval.reset = "never"
    c.eval.context = 512
    c.eval.stride = 32
    return c


def tiny():
    """The ``:tiny`` smoke run: configs/wikitext103/dense.py:tiny with causal EVA attention (block 32,
    chunks of 8, so 64-token training samples have C = 8 chunks)."""
    c = dense.get_config("tiny")
    c.model.attention.name = "eva"
    c.model.attention.eva.window_size = 32
    c.model.attention.eva.chunk_size = 8
    return c


def node8(c):
    """The launch on one node of 8 x 80 GB GPUs (``:node8``), same batch (144 rows of 512) as the paper's
    73,728 tokens per update: bf16 activations over fp32 master weights, the layers stacked and scanned,
    each block rematerialised with nothing saved, data parallel over the 8 GPUs (data = 8,
    18 rows per device; parameters and AdamW moments replicated). model.vocab_size is the corpus's fixed 267,735 words, so the plan needs no data."""
    c.model.vocab_size = 267_735
    return gpu_node(c, data=8, remat_policy="nothing_saveable")
