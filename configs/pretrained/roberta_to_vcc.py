"""VCC's recipe on an imported RoBERTa-style masked-LM encoder (docs/pretrained.md, "Adapt"; docs/methods/vcc.md
§3.2): the learned positions extended to 4x by copying the source's rows (``--extend_positions=4``), VCC in every
layer (the first ``num_dense_layers`` plain, on 512-token segments), and continued masked-LM training at the new
length with the masked tokens as VIP tokens, masked by VCC's clustered scheme, with the tokenizer's own ``<mask>``:

    longctx-convert import --hf_dir=/models/roberta-base --workdir=runs/roberta_vcc --extend_positions=4 \\
        --config=configs/pretrained/roberta_to_vcc.py --config.data.path=/data/my_corpus
    longctx-train --config=<run>/config.py --workdir=<run>

VCC's settings are the release's base model scaled to the length: 4 dense + 8 VCC layers of RoBERTa-base's 12,
blocks of 16 tokens, 320 VIP slots and 44 fine blocks at 4,096 tokens become 160 slots and 22 fine blocks at
2,048 (the masked share 320/4096 and the refined share of the blocks kept). RoBERTa is post-norm; VCC's stack
takes its blocks as they are (model.post_norm; the update of a compressed row is the block's output minus its
input: longctx/attention/vcc/stack.py), where the paper continued from the authors' own pre-LN RoBERTa.
Optimizer as the paper's continued pretraining (Adam betas (0.9, 0.98), eps 1e-6, weight decay 0.01, clip 1.0),
with a smaller learning rate and a shorter run.

``:tiny`` fits the committed fixture (tests/fixtures/hf/roberta_tiny: 2 layers, 32 positions, so 128 after the
extension) for a CPU smoke run; the fixture has no tokenizer.json (the import refuses the bytes tokenizer's 256
ids for its 96): give its folder one whose vocabulary ends in ``<mask>`` (tests/convert/hf_tokenizers.py writes
one; docs/pretrained.md, "Adapt").
"""

from longctx.config import base_config as base

VARIANTS = ("tiny",)


def get_config(arg: str | None = None):
    c = base()
    c.data.source = "files"
    c.data.path = ""  # --config.data.path=/path/to/your/corpus
    c.model.kind = "encoder"
    c.model.attention.name = "vcc"
    c.model.dtype = "auto"
    v = c.model.attention.vcc
    m = c.mlm
    t = c.train
    if arg == "tiny":
        t.seq_len = 128  # 4 x the fixture's 32 positions
        v.update(num_vip=16, block_size=8, num_fine_blocks=2, num_dense_layers=1, dense_segment_len=32)
        m.clusters, m.cluster_sigma = (2, 4), (4.0, 8.0)
        t.batch_size, t.steps, t.lr, t.warmup_steps = 4, 20, 3e-3, 2
        t.eval_every = t.ckpt_every = 20
    else:
        t.seq_len = 2048  # 4 x RoBERTa's 512 positions (the import lowers it to the extended table's length)
        v.update(num_vip=160, block_size=16, num_fine_blocks=22, num_dense_layers=4, dense_segment_len=512)
        t.batch_size, t.steps, t.lr, t.warmup_steps = 8, 2000, 3e-5, 100
        t.eval_every = t.ckpt_every = 250
    m.masking = "clustered"
    m.rate = v.num_vip / t.seq_len  # every masked token has a VIP slot (320 of 4,096 in the paper's runs)
    t.b1, t.b2, t.eps, t.grad_clip = 0.9, 0.98, 1e-6, 1.0
    t.weight_decay = 0.01
    return c
