"""An imported Llama-family model made a hybrid: three layers of EVA then one exact layer, repeated to the depth;
attention transfer, then fine-tuning (docs/pretrained.md, "Adapt").

Stage 1 (this config, ``train.task='attention_transfer'``) trains only the EVA layers' own parameters, each
matched to exact attention on its q, k, v; stage 2 resumes the run as an ordinary language model:

    longctx-convert import --hf_dir=/models/Llama-3.2-1B --workdir=runs/llama_hybrid \\
        --config=configs/pretrained/llama_to_hybrid.py --config.data.path=/data/my_corpus
    longctx-train --config=<run>/config.py --workdir=<run>
    longctx-train --config=<run>/config.py --workdir=<run> \\
        --config.train.task=auto --config.train.steps=4000 --config.train.lr=2e-5

The pattern's length must divide the model's depth (16 layers: four groups). ``:tiny`` fits the committed
two-layer fixture (tests/fixtures/hf/llama_tiny) with the pattern ``eva, dense``.
"""

from configs.pretrained.llama_to_eva import get_config as eva_config

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = eva_config(arg)
    c.model.attention.pattern = ("eva", "dense") if arg == "tiny" else ("eva", "eva", "eva", "dense")
    return c
