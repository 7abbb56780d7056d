"""The shared recipe of the recall benchmark (configs/recall/<method>.py, scripts/recall_all.sh).

Multi-query associative recall on rows of 1,024 tokens (``data.source='mqar'``, generated on the
fly as a function of (seed, step, row), loss on the answer tokens only): 8 key-value pairs open
each row, every key is queried once somewhere in the rest of the row (random filler between), so
the distance from a query back to its pair ranges over the whole row. Chance is 1/16 (values).

Two choices make it learnable within a CPU budget, both measured here with the dense model:

* Each pair is one token (``fused_pairs``: id = key x 16 + value), so one attention layer can
  retrieve it by content. The classic two-token layout (``k v``) needs an induction circuit (a
  previous-token head feeding a matching head): a 2-layer dense model with rotary positions
  stayed at chance among the in-context values for 1,500 steps at 32 tokens and 2 pairs (79 %
  after 600 steps with learned positions), where the fused form reached 100 % in 200 (64 tokens,
  4 pairs). The benchmark therefore measures whether a method can *retrieve* one exact token,
  chosen by content, from anywhere in a 1k context, as a function of distance.
* Staged training (``train.short_steps``): the first 250 updates use rows of 64 tokens, where the
  retrieval is learned in ~200 updates; the last 50 use rows of 1,024. Trained on 1,024-token rows
  from the start (16 pairs, batch 8), the model stayed at chance for 150 updates (presumably:
  attention spread over 1k positions gives the right token a ~1/1000 share of the gradient at first).

Every method gets the same model size (d_model 64, 2 layers of 2 heads of 32, d_ff 512, trimmed
to the same parameter count, 182k, where a method has learned parts), the same data, steps, batch
and schedule; each ``configs/recall/<method>.py`` states only its attention settings, chosen so the
approximation is active at 1k (local parts of 64-128 tokens). ``:tiny`` is a seconds-long smoke
variant (rows of 64 tokens, 4 pairs).
"""

from longctx.config import base_config

SEQ_LEN = 1024


def recall(arg=None):
    c = base_config()
    c.data.source = "mqar"
    s = c.data.synthetic
    s.fused_pairs = True
    s.num_pairs = 8
    s.num_queries = 0  # = num_pairs: every key queried once
    s.num_keys = 8
    s.num_values = 16
    s.eval_rows = 128  # 1,024 answers
    s.bins = 8
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 32
    c.model.d_ff = 512
    c.train.seq_len = SEQ_LEN
    c.train.short_steps = 250  # staged: the first 250 updates on rows of 64 tokens, the last 50 on 1,024
    c.train.short_seq_len = 64
    c.train.batch_size = 16
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 30
    c.train.log_every = 25
    c.train.eval_every = 300
    c.train.ckpt_every = 250
    c.eval.batch_size = 8
    if arg == "tiny":
        s.num_pairs = 4
        s.eval_rows = 32
        s.bins = 4
        c.train.seq_len = 64
        c.train.short_steps = 4
        c.train.short_seq_len = 32
        c.train.batch_size = 8
        c.train.steps = 8
        c.train.warmup_steps = 2
        c.train.log_every = 1
        c.train.eval_every = 8
        c.train.ckpt_every = 8
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; allowed: tiny")
    return c


def hybrid(c, name: str, d_ff: int):
    """``c`` (a configs/recall/<name>.py config, its attention settings as they are) as a hybrid stack: the
    recall depth (2 layers) with layer 1 exact and layer 2 running ``name`` (``model.attention.pattern =
    ('dense', name)``), ``d_ff`` trimmed so the parameter count matches the dense run's (182,016) within 1 %.
    The exact layer comes first: the staged schedule's short rows (64 tokens, inside every method's local part)
    teach the retrieval to the first layer, which then must reach the whole 1,024-token row; with the method
    first the hybrids stayed at their pure method's accuracy (0.07-0.28 against dense's 0.70). Positions are the
    recipe's rotary, applied in each layer whose method takes it (a method with its own position signal, e.g. a
    relative bias, runs its layer unrotated), so the exact layer is the dense run's layer."""
    c.model.attention.name = name
    c.model.attention.pattern = ("dense", name)
    c.model.d_ff = d_ff
    return c
