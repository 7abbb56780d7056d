"""WikiText-103 word-level LM with causal EVA attention (Zheng et al. 2023, §5.2 / App. E.3):
16 layers, ~247M parameters in the paper's fairseq model.

Departures from the paper (framework limits, stated rather than guessed): optimizer AdamW
instead of NAG (lr 1.0, momentum 0.99, cosine with restarts); no activation dropout; the
adaptive input embedding is replaced by a plain embedding + an untied adaptive softmax
(model.output='adaptive'); blocks are always pre-LN with a final LN.

    longctx-prepare --config configs/wikitext103/eva_16l.py --config.data.path=/data/wikitext-103
    longctx-train   --config configs/wikitext103/eva_16l.py --config.data.path=/data/wikitext-103 --workdir runs/wt103_eva16
    longctx-eval    --workdir runs/wt103_eva16 --split test              # context 480
    longctx-eval    --workdir runs/wt103_eva16 --split test --config.eval.stride=256   # context 256

``:tiny`` is a 2-layer causal-EVA decoder for a CPU smoke run (a few minutes): configs/wikitext103/dense.py:tiny
with EVA attention (block 32, chunks of 8):

    longctx-train   --config configs/wikitext103/eva_16l.py:tiny --config.data.path=/data/wikitext-103 --workdir runs/wt103_eva_tiny
    longctx-eval    --workdir runs/wt103_eva_tiny --split test --config.eval.max_tokens=16384

One node of 8 GPUs of 80 GB (``:node8``, the paper's batch and rows: data = 8, bf16, scanned layers, remat nothing_saveable;
see node8() in configs/wikitext103/_eva_common.py):

    longctx-train --config configs/wikitext103/eva_16l.py:node8 --config.data.path=/data/wikitext-103 --workdir runs/wt103_eva16_node8

Its per-device memory plan on 8 simulated devices (a row of the README's flagship table,
scripts/flagship_plans.py; at most 70 GiB per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=configs/wikitext103/eva_16l.py:node8 --dry_run
"""

from configs.wikitext103 import _eva_common

VARIANTS = ("tiny", "node8")


def get_config(arg: str | None = None):
    return _eva_common.eva_wt103(num_layers=16, arg=arg)
