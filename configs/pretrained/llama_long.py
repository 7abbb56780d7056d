"""Continued pretraining of an imported Llama-family model at a longer context (docs/pretrained.md).

``longctx-convert import`` takes this file as the run's config: the Hugging Face folder's config.json decides
the architecture (and its tokenizer.json replaces ``data.tokenizer``), this file decides everything else:
your corpus (``data.source='files'``, ``data.path`` on the command line), rows of 8,192 tokens, a small
learning rate with a short warm-up, bfloat16 compute on GPU / TPU, per-block remat and the chunked loss that a
large vocabulary needs. Then ``longctx-train`` resumes the imported run with this same config, saved in the
run folder:

    longctx-convert import --hf_dir=/models/Llama-3.2-1B --workdir=runs/llama_long \
        --config=configs/pretrained/llama_long.py --config.data.path=/data/my_corpus
    longctx-train --config=<run>/config.py --workdir=<run>

``:tiny`` fits the committed fixture (tests/fixtures/hf/llama_tiny) for a CPU smoke run of the whole path
(rows of 128 tokens, 20 updates):

    longctx-convert import --hf_dir=tests/fixtures/hf/llama_tiny --workdir=runs/llama_tiny \
        --config=configs/pretrained/llama_long.py:tiny --config.data.path=/data/my_corpus
"""

from longctx.config import base_config as base

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "files"
    c.data.path = ""  # set on the command line: --config.data.path=/path/to/your/corpus
    c.model.dtype = "auto"  # bfloat16 on GPU / TPU, float32 on CPU
    c.model.remat = True
    c.model.loss_chunk = 8192  # exact softmax NLL over vocabulary chunks: no [B, T, V] logits at 128k tokens
    t = c.train
    t.seq_len = 8192
    t.window = 0
    t.batch_size = 8
    t.steps = 2000
    t.lr = 2e-5
    t.warmup_steps = 100
    t.min_lr_ratio = 0.1
    t.weight_decay = 0.1
    t.grad_clip = 1.0
    t.eval_every = 250
    t.ckpt_every = 250
    t.eval_tokens = 65536
    if arg == "tiny":
        c.model.remat = False
        c.model.loss_chunk = 0
        t.seq_len, t.batch_size, t.steps, t.warmup_steps = 128, 2, 20, 2
        t.lr = 1e-3
        t.eval_every = t.ckpt_every = 10
        t.log_every = 5
        t.eval_tokens = 1024
    return c
