"""VCC's recipe on an imported RoBERTa-style masked-LM encoder (docs/pretrained.md, "Adapt"): the learned
positions extended to 4x by copying the source's rows (``--extend_positions=4``), VCC in every layer, and
continued masked-LM training at the new length:

    longctx-convert import --hf_dir=/models/roberta-base --workdir=runs/roberta_vcc --extend_positions=4 \\
        --config=configs/pretrained/roberta_to_vcc.py --config.data.path=/data/my_corpus
    longctx-train --config=<run>/config.py --workdir=<run>

Not runnable yet, each refused in one line: VCC runs the blocks in its own stack wrapper, which does not take
RoBERTa's post-norm blocks (``model.post_norm``), and continued masked-LM training with the model's own tokenizer
(whose ``[MASK]`` is inside its vocabulary) is not available (docs/pretrained.md, "I have a BERT or RoBERTa").
The position extension itself works with exact attention: ``--config.model.attention.name=dense``.
"""

from longctx.config import base_config as base


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "files"
    c.data.path = ""  # --config.data.path=/path/to/your/corpus
    c.model.kind = "encoder"
    c.model.attention.name = "vcc"
    c.model.dtype = "auto"
    t = c.train
    t.seq_len = 2048  # 4 x RoBERTa's 512 positions (the import lowers it to the extended table's length)
    t.batch_size = 8
    t.steps = 2000
    t.lr = 3e-5
    t.warmup_steps = 100
    t.weight_decay = 0.01
    t.eval_every = t.ckpt_every = 250
    return c
