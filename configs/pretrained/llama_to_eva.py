"""An imported Llama-family model with EVA in every other layer: attention transfer, then fine-tuning
(docs/pretrained.md, "Adapt").

The import keeps the source's projections, MLP and norms in every layer; the odd layers hand their q, k, v to EVA,
whose own parameters start from EVA's initialisation. Stage 1 (this config, ``train.task='attention_transfer'``)
trains only those parameters, each swapped layer's EVA output matched to exact attention on the same q, k, v;
stage 2 resumes the same run as an ordinary language model (``train.task=auto``), everything training, for
``train.steps`` more updates:

    longctx-convert import --hf_dir=/models/Llama-3.2-1B --workdir=runs/llama_eva \\
        --config=configs/pretrained/llama_to_eva.py --config.data.path=/data/my_corpus
    longctx-train --config=<run>/config.py --workdir=<run>
    longctx-train --config=<run>/config.py --workdir=<run> \\
        --config.train.task=auto --config.train.steps=4000 --config.train.lr=2e-5

``:tiny`` fits the committed fixture (tests/fixtures/hf/llama_tiny) for a CPU smoke run.
"""

from configs.pretrained.llama_long import get_config as long_config

VARIANTS = ("tiny",)
PATTERN = ("dense", "eva")


def get_config(arg: str | None = None):
    c = long_config(arg)
    c.model.attention.pattern = PATTERN
    c.train.task = "attention_transfer"
    t = c.train
    t.steps = 1000 if arg != "tiny" else 20
    t.lr = 1e-3  # only the swapped cores' new parameters train
    t.weight_decay = 0.0
    if arg == "tiny":
        c.model.attention.eva.window_size = 8
        c.model.attention.eva.chunk_size = 4
    return c
