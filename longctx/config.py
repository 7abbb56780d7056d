"""Base config and validation.

Every experiment file in ``configs/`` starts from :func:`base_config` (or from another
config, by import: ``from configs import default``) and states only what differs; how config
files are found and their ``FILE:VARIANT`` form are in :mod:`longctx.config_files`.
:func:`validate` turns a config into one resolved, frozen ConfigDict or raises
:class:`ConfigError` with one actionable line.
"""

from __future__ import annotations

import glob
import importlib
import json
import math
import os

import ml_collections

from longctx import attention
from longctx.attention import dispatch
from longctx.attention.base import segments_refusal
from longctx.data import sources, tokenizers
from longctx.errors import ConfigError
from longctx.models import blocks
from longctx.models.backbone import REMAT_POLICIES, SCAN_LAYERS, scans_layers
from longctx.models.backbone import _check_pattern as check_layers
from longctx.models.blocks import layer_methods, takes_rotary
from longctx.train import sharding as sharding_lib
from longctx.train.sequence_parallel import TRAIN_MODES

FORMAT_VERSION = 1


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.data = ml_collections.ConfigDict()
    c.data.source = "builtin"  # see longctx.data.sources.names()
    c.data.path = ""  # dataset file or folder for real datasets
    c.data.cache_dir = ""  # '' -> $LONGCTX_CACHE or ~/.cache/longctx
    c.data.tokenizer = "bytes"  # see longctx.data.tokenizers.names()
    c.data.options = ml_collections.ConfigDict({
        "txl_compat": False,  # enwik8: drop newline bytes (Transformer-XL convention)
        "raw": False,  # wikitext103: read wiki.*.raw instead of wiki.*.tokens
        "vocab_size": 0,  # sentencepiece / bpe: ids in the vocabulary (0: the tokenizer's default, 32,000 / 4,096)
        "verify": True,  # check sizes / checksums / official counts of real dataset files
        "tfds": False,  # pg19: read through tensorflow_datasets' pg19 builder
        "spm_max_chars": 1_000_000_000,  # sentencepiece: train on the first N characters of train
        # files / hf (your own corpus; docs/datasets.md, longctx/data/files.py and hf.py)
        "format": "auto",  # files: 'auto' (by file name) | 'text' | 'jsonl' | 'parquet'
        "text_field": "text",  # files / hf: the JSONL field / Parquet column holding the text
        "separator": "",  # files: '' = one document per text file, else the marker between documents (\\n = newline)
        "split": (0.9, 0.05, 0.05),  # files / hf: train, valid, test fractions of data.path (seeded permutation)
        "split_seed": 0,
        "train_path": "",  # files / hf: the splits given as paths instead (file, folder or glob)
        "valid_path": "",
        "test_path": "",
        "hf_builder": "",  # hf: datasets builder 'json' | 'parquet' | 'text' | 'csv' ('' = by file name)
        "tokenizer_file": "",  # data.tokenizer='hf': a Hugging Face tokenizer.json
        "eos_token": "",  # data.tokenizer='hf': end-of-document token ('' = the first of <|endoftext|>, </s>, ...)
    })
    # training rows: 'document' (each row inside one document; shorter documents are not trained on),
    # 'pack' (rows of consecutive documents separated by the end-of-document token, attention running across them)
    # or 'segments' (the same rows with segment ids and positions: each document attended alone; methods that take
    # segment ids only); longctx/data/batching.py. 'auto': 'segments' for a prepared corpus of several documents
    # whose every layer takes segment ids, else 'document' (packing_rule says which and why, at the start of a run)
    c.data.packing = "auto"
    # generated recall tasks (data.source = 'mqar' | 'passkey' | 'copy'; longctx/data/synthetic.py)
    c.data.synthetic = ml_collections.ConfigDict({
        "num_pairs": 16,  # mqar: key-value pairs opening each row
        "num_queries": 0,  # mqar: keys queried later in the row (0 -> num_pairs); each at most once
        "num_keys": 64,  # mqar: key ids [0, num_keys)
        "num_values": 64,  # mqar: value ids num_keys + [0, num_values); the ids above are filler
        "fused_pairs": False,  # mqar: each pair is one token (id key * num_values + value, ids below the keys')
        "passkey_len": 5,  # passkey: digits of the pass key
        "copy_len": 8,  # copy: tokens of the segment to repeat
        "copy_vocab": 64,  # copy: segment ids [0, copy_vocab); filler ids above; 255 marks the copy
        "distance": (0, 0),  # passkey / copy: answer distances drawn in [lo, hi] (0 -> shortest / longest that fits)
        "eval_rows": 256,  # evaluation: rows scored (seed eval_seed, step 0, row i; spread over the bins)
        "eval_seed": 4321,
        "bins": 8,  # evaluation: distance bins
        # data.packing='segments': each training row packs independent examples of at least this many inputs
        # (segment ids and positions restart at each; evaluation scores single examples of this length)
        "example_len": 0,
    })

    c.model = ml_collections.ConfigDict()
    c.model.kind = "decoder"  # 'decoder' (causal LM) | 'encoder' (masked LM, bidirectional blocks; see the mlm section)
    c.model.vocab_size = 0  # 0 -> the tokenizer's vocabulary size
    c.model.d_model = 256
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.head_dim = 64
    c.model.d_ff = 1024
    # transformer blocks (longctx/models/blocks.py:TransformerBlock); the defaults build the model as before the keys:
    c.model.num_kv_heads = 0  # grouped-query attention: k/v heads, a divisor of num_heads (0 = num_heads)
    c.model.mlp = "gelu"  # 'gelu' (down(GELU(up x))) | 'swiglu' | 'geglu' (gated: down(act(gate x) * up x))
    c.model.mlp_bias = True  # biases on the MLP's projections
    c.model.qkv_bias = False  # biases on the q/k/v projection
    c.model.out_bias = False  # bias on the attention's output projection
    c.model.rope_theta = 10000.0  # rotary base (Hugging Face's rope_theta; the rotate-half layout)
    c.model.norm_eps = 1e-6  # the norms' epsilon (LayerNorm and RMSNorm)
    c.model.block = "transformer"  # see longctx.models.blocks.block_names()
    c.model.norm = "layernorm"  # 'layernorm' | 'rmsnorm'
    # 'none' | 'learned' | 'sinusoidal' | 'rotary' (rotary: in each layer whose method takes it, a pattern's others
    # run unrotated; longctx.models.blocks.takes_rotary)
    c.model.positions = "rotary"
    c.model.max_len = 0  # learned positions: table size (0 -> train.seq_len)
    c.model.dropout = 0.0
    c.model.tie_embeddings = True
    # encoders of the BERT kind (each default builds the model as before the keys existed):
    # post_norm: post-norm transformer blocks x = norm(x + attn(x)); x = norm(x + mlp(x)), a norm after the embeddings
    # and none after the last block; type_vocab_size > 0: a token-type embedding table of that many rows, its row 0
    # added to every token (the data carries no segment ids); position_offset: learned positions, the token at
    # position p reads row p + position_offset of a table of max_len + position_offset rows (RoBERTa: 2);
    # head_transform: dense + GELU + norm on the hidden states before the output projection (the MLM head's
    # transform; exact GELU with model.mlp='gelu_exact', else its tanh form); head_bias: a bias on the logits
    c.model.post_norm = False
    c.model.type_vocab_size = 0
    c.model.position_offset = 0
    c.model.head_transform = False
    c.model.head_bias = False
    c.model.output = "dense"  # 'dense' (full softmax) | 'adaptive' (adaptive softmax, large vocabularies)
    # recompute each block's forward in the backward (remat per block): activation memory of one block
    # instead of all of them, for ~1/4 more FLOPs; refused with a method whose stack wrapper runs the blocks
    c.model.remat = False
    # how a rematerialised block is recomputed: 'auto' (XLA:CPU: 'cotangent_tied', a custom VJP whose recomputation
    # waits for the block's cotangent; other backends: jax.checkpoint with 'nothing_saveable'), or one of
    # 'cotangent_tied' | 'nothing_saveable' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
    c.model.remat_policy = "auto"
    # 'on': identical blocks' parameters and per-layer state stacked on a leading 'layers' axis and run by one
    # scan (compile time flat in depth); 'off': one module per block; 'auto': resolved by validate() to 'on' where
    # the scan applies (one method in every layer, no stack wrapper, ...: _scan_applies) on a GPU / TPU, and to
    # CPU_SCAN_LAYERS on a CPU. A checkpoint of either layout restores into the other
    # (longctx/models/backbone.py:relayout)
    c.model.scan_layers = "auto"
    # precision policy (longctx/models/precision.py), applied where the backbone and blocks build their layers:
    # 'dtype' is the compute dtype of activations and matmul inputs ('auto': bfloat16 on GPU/TPU, float32 on CPU |
    # 'float32' | 'bfloat16' | 'float16'); 'param_dtype' the dtype of the master weights and so of the optimizer
    # state. Softmax statistics, norms' statistics, the loss, codebook EMA statistics and sampling stay float32.
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"
    c.model.loss_chunk = 0  # dense output: >0 -> exact softmax NLL over vocabulary chunks of this size (no [B,T,V])
    c.model.adaptive_cutoffs = (20000, 40000, 200000)
    c.model.adaptive_div = 4.0
    c.model.causal = True
    c.model.gau_expansion = 2.0  # GAU blocks: value width H*Dv = gau_expansion * d_model
    c.model.gau_layerdrop = 0.0  # GAU blocks: per-example probability of dropping a GAU's residual branch
    c.model.attention = ml_collections.ConfigDict()
    c.model.attention.name = "dense"
    # per-layer methods (a hybrid stack): () = every layer runs `name`; else method names, exactly num_layers of
    # them or a group repeated to the depth, e.g. (A, A, A, "dense") for an efficient method A; each layer takes its method's
    # settings from model.attention.<method> and execution.attention.<method>; `name` must be one of them (the
    # method logs and reports name). Not with a stack-wrapper method, nor yet with scan_layers='on' or mesh.sequence > 1
    c.model.attention.pattern = ()
    for name in attention.names():
        c.model.attention[name] = attention.model_config(name)

    c.train = ml_collections.ConfigDict()
    c.train.seed = 0
    c.train.steps = 2000  # optimizer updates (windows), a multiple of seq_len // window
    c.train.batch_size = 16
    c.train.seq_len = 256
    c.train.window = 0  # 0 -> seq_len (plain full-sequence training)
    # staged training (Shortformer-style length curriculum): the first short_steps updates use rows of
    # short_seq_len tokens, the rest rows of seq_len; 0 = off. Trained in windows (window < seq_len), both phases'
    # rows are cut into the same windows (short_seq_len a multiple of window); decoders only.
    c.train.short_steps = 0
    c.train.short_seq_len = 0
    c.train.lr = 3e-3
    c.train.warmup_steps = 100
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.01
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.grad_clip = 1.0
    c.train.on_nonfinite = "stop"  # 'stop' | 'skip'
    c.train.max_skipped_in_row = 20  # on_nonfinite='skip': stop after this many skipped updates in a row
    # loss scaling: 'auto' ('dynamic' for model.dtype='float16', else 'none') | 'dynamic' | 'none' | a fixed scale
    # ('1024'). Dynamic: the scale starts at loss_scale_init, is halved after an update with non-finite gradients
    # (skipped, not counted towards max_skipped_in_row) and doubled after loss_scale_period finite updates in a row
    c.train.loss_scale = "auto"
    c.train.loss_scale_init = 32768.0  # 2**15
    c.train.loss_scale_period = 2000
    c.train.log_every = 25
    c.train.eval_every = 500
    c.train.eval_tokens = 32768  # tokens scored by the periodic validation
    c.train.ckpt_every = 500
    c.train.keep_checkpoints = 3
    c.train.async_checkpoints = True
    c.train.microbatches = 1  # gradient accumulation: each update's rows run in this many micro-batches
    # 'auto': the task the data and model imply (language model, masked LM, generated recall);
    # 'attention_transfer': each swapped layer's core learns to match exact attention on its q, k, v, nothing else
    # trains (longctx/train/tasks.py; docs/pretrained.md, "Adapt")
    c.train.task = "auto"
    # JAX's persistent compilation cache, so a restarted run does not compile again: '' -> the
    # JAX_COMPILATION_CACHE_DIR environment variable if set, else <data cache dir>/jax_compile; 'none' -> off
    c.train.compilation_cache_dir = ""

    c.eval = ml_collections.ConfigDict()
    c.eval.split = "valid"
    c.eval.protocol = "stream"  # 'stream' (windows, state carried) | 'sliding' (context C, stride S)
    c.eval.reset = "document"  # stream: reset state at 'document' starts (and every row_len), 'row', or 'never'
    c.eval.row_len = 0  # stream: reset every row_len tokens (0 -> train.seq_len; -1 -> never within a document)
    c.eval.window = 0  # stream: tokens per forward call (0 -> train window)
    c.eval.context = 0  # sliding: context C (0 -> train.seq_len)
    c.eval.stride = 0  # sliding: stride S (0 -> context // 2)
    c.eval.max_tokens = 0  # 0 -> the full split; else score this many tokens (stated in the result)
    # 0 -> no byte budget; else score the jobs in order until the scored tokens' bytes reach this many (a lossless
    # tokenizer: the same bytes whatever the tokenizer; stated in the result). At most one of the two budgets
    c.eval.max_bytes = 0
    c.eval.batch_size = 8

    # masked-language-model training and evaluation (model.kind='encoder'); longctx/data/masking.py
    c.mlm = ml_collections.ConfigDict()
    c.mlm.masking = "bert"  # 'bert' (uniform) | 'span' (contiguous spans) | 'clustered' (VCC, docs/methods/vcc.md §3.2)
    c.mlm.rate = 0.15  # predicted positions per row: round(rate * row length), exactly
    c.mlm.mask_prob = 0.8  # a predicted position's input becomes the mask token ...
    c.mlm.random_prob = 0.1  # ... or a random text token (else it stays unchanged)
    c.mlm.span_len = 3.0  # span: mean span length (geometric)
    c.mlm.max_span_len = 10  # span: longest span
    c.mlm.clusters = (4, 16)  # clustered: number of centres per row, drawn uniformly in this range
    c.mlm.cluster_sigma = (32.0, 64.0)  # clustered: width of the clusters in tokens, drawn uniformly
    c.mlm.eval_seed = 1234  # evaluation: one fixed masking of the split, the same for every run and method
    c.mlm.mask_id = -1  # the mask token: -1 -> the tokenizer's vocabulary size (one id beyond its vocabulary)

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "def "
    c.sample.num_tokens = 256
    c.sample.temperature = 0.8
    c.sample.top_k = 0
    c.sample.top_p = 0.95
    c.sample.seed = 0

    # data x fsdp split the batch; fsdp and tensor split parameters by their logical axis names;
    # sequence splits the token axis of the activations. rules: "name=axis[+axis],..." overrides
    # the logical-axis -> mesh-axis table of longctx/train/sharding.py.
    # sequence_mode: how a row is split over mesh.sequence in training: 'compose' (per-layer prefix
    # scan of carried attention states over the devices, longctx/train/sequence_parallel.py), 'xla'
    # (tokens constrained to the axis, XLA's partitioner moves the data), 'auto' (compose where
    # every attention core composes its state at that slice length, else xla).
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "sequence": 1, "rules": "",
                                        "sequence_mode": "auto"})

    # how the model is computed, never what: each attention method's implementation choice, tiles and budgets
    # (its EXECUTION_KEYS; docs/DESIGN.md "Implementations and the execution section"). Changing one changes
    # no parameter and no result beyond floating-point rounding, so a run trained with one setting evaluates
    # with another.
    c.execution = ml_collections.ConfigDict()
    c.execution.attention = ml_collections.ConfigDict()
    for name in attention.names():
        c.execution.attention[name] = attention.execution_config(name)
    return c


_CHOICES = {
    "data.packing": ("auto", "document", "pack", "segments"),
    "data.options.format": ("auto", "text", "jsonl", "parquet"),
    "model.kind": ("decoder", "encoder"),
    "mlm.masking": ("bert", "span", "clustered"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.positions": ("none", "learned", "sinusoidal", "rotary"),
    "model.output": ("dense", "adaptive"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16", "float16"),
    "model.mlp": ("gelu", "gelu_exact", "swiglu", "geglu"),
    "model.scan_layers": SCAN_LAYERS,
    "train.on_nonfinite": ("stop", "skip"),
    "train.task": ("auto", "attention_transfer"),
    "eval.split": ("train", "valid", "test"),
    "eval.protocol": ("stream", "sliding"),
    "eval.reset": ("document", "row", "never"),
}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_against_base(cfg: ml_collections.ConfigDict, base: ml_collections.ConfigDict | None = None, prefix=""):
    """Unknown keys and wrong types, reported with the allowed keys."""
    base = base_config() if base is None else base
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in base:
            allowed = ", ".join(sorted(base.keys()))
            raise ConfigError(f"config key {path!r} is unknown; allowed keys here: {allowed}")
        want, got = base[key], cfg[key]
        if isinstance(want, ml_collections.ConfigDict):
            if not isinstance(got, ml_collections.ConfigDict):
                raise ConfigError(f"config {path} must be a section, got {got!r}")
            if path in ("model.attention", "execution.attention"):
                continue  # checked by the attention registry
            check_against_base(got, want, prefix=path + ".")
        elif not _same_kind(want, got) and path in _CHOICES:
            raise ConfigError(f"config {path}={got!r} is not allowed; choose one of: {', '.join(_CHOICES[path])}")
        elif not _same_kind(want, got):
            raise ConfigError(f"config {path}={got!r}: expected {type(want).__name__}, got {type(got).__name__}")


def _same_kind(want, got) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool)
    if isinstance(want, float):
        return isinstance(got, (int, float))
    if isinstance(want, (tuple, list)):  # JSON round trips turn tuples into lists
        return isinstance(got, (tuple, list))
    return isinstance(got, type(want))


def _finite(x) -> bool:

    return math.isfinite(x)


# The allowed range of every numeric key, checked before any default is resolved: (key, test, what
# is allowed). A key whose range depends on others (warm-up, window, stride <= context, ...) is also
# checked below, with the keys it depends on.
MAX_SAMPLE_TOKENS = 1 << 20  # longest sample (the decoding state grows with it)
_POS = (lambda v: v > 0, "a positive integer")
_NONNEG = (lambda v: v >= 0, "an integer >= 0")
_RANGES = (
    *((f"model.{k}", *_POS) for k in ("d_model", "num_layers", "num_heads", "head_dim", "d_ff")),
    ("model.vocab_size", lambda v: v >= 0, "an integer >= 0 (0 = the tokenizer's vocabulary size)"),
    ("model.max_len", lambda v: v >= 0, "an integer >= 0 (0 = train.seq_len)"),
    ("model.loss_chunk", lambda v: v >= 0, "an integer >= 0 (0 = full logits)"),
    ("model.dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("model.gau_expansion", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("model.gau_layerdrop", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("model.adaptive_div", lambda v: _finite(v) and v >= 1, "a finite number >= 1"),
    ("model.num_kv_heads", lambda v: v >= 0, "an integer >= 0 (0 = model.num_heads)"),
    ("model.rope_theta", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("model.norm_eps", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("model.type_vocab_size", lambda v: v >= 0, "an integer >= 0 (0 = no token-type embeddings)"),
    ("model.position_offset", lambda v: v >= 0, "an integer >= 0"),
    ("train.seed", lambda v: v >= 0, "an integer >= 0"),
    *((f"train.{k}", *_POS) for k in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "ckpt_every",
                                      "keep_checkpoints", "eval_tokens", "max_skipped_in_row",
                                      "microbatches", "loss_scale_period")),
    ("train.loss_scale_init", lambda v: _finite(v) and v >= 1, "a finite number >= 1"),
    ("train.window", lambda v: v >= 0, "an integer >= 0 (0 = the whole sequence)"),
    ("train.short_steps", lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    ("train.short_seq_len", *_NONNEG),
    ("train.lr", lambda v: _finite(v) and v > 0, "positive (a finite number > 0)"),
    ("train.min_lr_ratio", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    ("train.weight_decay", lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    ("train.b1", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("train.b2", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("train.eps", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("train.grad_clip", lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0 = no clipping)"),
    ("eval.batch_size", *_POS),
    ("eval.row_len", lambda v: v >= -1, "an integer >= 1, or 0 (= train.seq_len) or -1 (never within a document)"),
    ("eval.window", lambda v: v >= 0, "an integer >= 1, or 0 (= the training window)"),
    ("eval.context", lambda v: v >= 0, "an integer >= 1, or 0 (= train.seq_len)"),
    ("eval.stride", lambda v: v >= 0, "an integer >= 1, or 0 (= eval.context // 2)"),
    ("eval.max_tokens", lambda v: v >= 0, "an integer >= 0 (0 = the full split)"),
    ("eval.max_bytes", lambda v: v >= 0, "an integer >= 0 (0 = no byte budget)"),
    ("sample.num_tokens", lambda v: 0 < v <= MAX_SAMPLE_TOKENS, f"a positive integer (at most {MAX_SAMPLE_TOKENS:,})"),
    ("sample.temperature", lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    ("sample.top_k", lambda v: v >= 0, "an integer >= 0 (0 = no top-k filter)"),
    ("sample.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("sample.seed", lambda v: v >= 0, "an integer >= 0"),
    ("mesh.data", lambda v: v == -1 or v >= 1, "an integer >= 1, or -1 (the devices the other axes leave)"),
    *((f"mesh.{k}", lambda v: v >= 1, ">= 1") for k in ("fsdp", "tensor", "sequence")),
    ("data.options.vocab_size", *_NONNEG),
    ("data.options.spm_max_chars", *_POS),
    ("data.options.split_seed", lambda v: v >= 0, "an integer >= 0"),
    ("mlm.rate", lambda v: 0.0 < v < 1.0, "in (0, 1)"),
    ("mlm.span_len", lambda v: _finite(v) and v >= 1, "a finite number >= 1"),
    ("mlm.max_span_len", lambda v: v >= 1, "an integer >= 1"),
    ("mlm.mask_id", lambda v: v >= -1, "an integer >= 0, or -1 (one id beyond the tokenizer's vocabulary)"),
    ("mlm.eval_seed", lambda v: v >= 0, "an integer >= 0"),
    ("data.synthetic.eval_seed", lambda v: v >= 0, "an integer >= 0"),
)


def check_ranges(c: ml_collections.ConfigDict) -> None:
    """The numeric keys against :data:`_RANGES` (NaN fails every test)."""
    for path, ok, allowed in _RANGES:
        val = _get(c, path)
        if not ok(val):
            raise ConfigError(f"config {path}={val!r} must be {allowed}")


class Rule:
    """A rule over a (partly resolved) config: where ``when(c)`` holds, ``ok(c)`` must hold too, else
    :class:`ConfigError` with ``message``: a format string over the config (``'{model.head_dim}'``
    is the value of ``model.head_dim``) or a function of the config."""

    def __init__(self, when, ok, message):
        self.when, self.ok, self.message = when, ok, message

    def __call__(self, c: ml_collections.ConfigDict) -> None:
        if self.when(c) and not self.ok(c):
            msg = self.message
            raise ConfigError(msg(c) if callable(msg) else msg.format_map(c))


class When:
    """A check that needs code, run where ``when(c)`` holds: ``check(c)`` raises its own :class:`ConfigError`."""

    def __init__(self, when, check):
        self.when, self.check = when, check

    def __call__(self, c: ml_collections.ConfigDict) -> None:
        if self.when(c):
            self.check(c)


def _always(c) -> bool:
    return True


def _encoder(c) -> bool:
    return c.model.kind == "encoder"


def _generated(c) -> bool:

    return sources.is_generated(c.data.source)


def packing_rule(c, num_docs: int | None = None) -> tuple[str, str]:
    """``(rule, why)``: the packing rule a run trains with. A rule given by name is itself (``why`` empty).
    ``'auto'`` (the default) is ``'segments'`` (every row filled with documents back to back, each attended alone)
    for a prepared corpus whose every layer takes segment ids, and ``'document'`` where it cannot: a generated task
    (``'segments'`` where it packs examples, ``data.synthetic.example_len > 0``), an attention transfer (whole
    unpacked rows), a layer whose method or settings refuse packed rows, or a train split of one document
    (a source that is one document, enwik8; ``num_docs`` where the data is loaded: no boundary to keep). ``why``
    says which, for the run's first lines."""
    rule = c.data.packing
    if rule != "auto":
        return rule, ""
    if _generated(c):
        if c.data.synthetic.example_len > 0:
            return "segments", f"data.synthetic.example_len={c.data.synthetic.example_len} packs examples"
        return "document", f"data.source={c.data.source!r} generates whole rows"
    if _transfer(c):
        return "document", "train.task='attention_transfer' trains on whole unpacked rows"
    for name in dict.fromkeys(layer_methods(c.model)):
        cls = attention.get_class(name)
        if not cls.takes_segments:
            return "document", f"{name} takes no segment ids"
        if cls.packed_refusal(c.model.attention[name]) is not None:
            return "document", f"{name}'s settings refuse packed rows"
    if (num_docs is not None and num_docs < 2) or sources.single_document(c.data.source):
        return "document", "the train split is one document"
    docs = f" of {num_docs:,} documents" if num_docs is not None else ""
    return "segments", f"a corpus{docs} whose every layer takes segment ids"


def resolve_packing(cfg: ml_collections.ConfigDict, num_docs: int | None) -> tuple[ml_collections.ConfigDict, str]:
    """A copy of ``cfg`` with ``data.packing`` the rule :func:`packing_rule` gives for a train split of
    ``num_docs`` documents (None: generated rows), and a line for the run's start where it was ``'auto'``
    (empty otherwise)."""
    rule, why = packing_rule(cfg, num_docs)
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.data.packing = rule
    return out, (f"data.packing='auto' -> {rule!r}: {why}" if cfg.data.packing == "auto" else "")


def _check_packing(c) -> None:
    """``data.packing='segments'``: a prepared corpus (a decoder or an encoder) or a generated task packing its
    examples (``data.synthetic.example_len``), and every layer's method taking segment ids
    (``AttentionCore.takes_segments``), refused in one line before any work; ``'auto'`` asks none of these
    (:func:`packing_rule` picks what the config can run)."""
    if c.data.packing == "auto":
        return
    if c.data.packing != "segments":
        if _generated(c) and c.data.synthetic.example_len:
            raise ConfigError(f"data.synthetic.example_len={c.data.synthetic.example_len} packs examples into rows "
                              "with data.packing='segments'; set that, or leave example_len at 0")
        return
    if _generated(c) and not (sources.build(c.data).packs_examples and c.data.synthetic.example_len > 0):
        why = ("set data.synthetic.example_len (the inputs of one example) to pack its examples"
               if sources.build(c.data).packs_examples else "it has no examples to keep apart")
        raise ConfigError(f"data.packing='segments' applies to prepared corpora and packed recall examples; "
                          f"data.source={c.data.source!r} generates whole rows: {why}, or leave data.packing at "
                          "its default")

    for name in dict.fromkeys(layer_methods(c.model)):
        if not attention.get_class(name).takes_segments:
            raise ConfigError(segments_refusal(name))
        why = attention.get_class(name).packed_refusal(c.model.attention[name])
        if why is not None:
            raise ConfigError(why)


def _transfer(c) -> bool:
    return c.train.task == "attention_transfer"


def _check_transfer(c) -> None:
    """``train.task='attention_transfer'``: a decoder on a prepared corpus trained on whole unpacked rows on one
    device per row, unrolled transformer blocks, and at least one layer whose method is not the exact one."""
    if not _transfer(c):
        return

    why = ("model.kind='encoder'" if _encoder(c) else
           f"data.source={c.data.source!r} (a generated task)" if _generated(c) else
           f"train.window={c.train.window} < train.seq_len" if c.train.window not in (0, c.train.seq_len) else
           "data.packing='segments'" if c.data.packing == "segments" else
           f"mesh.sequence={c.mesh.sequence}" if c.mesh.sequence > 1 else
           "model.scan_layers='on'" if scans_layers(c.model) else
           f"model.block={c.model.block!r}" if c.model.block != "transformer" else None)
    if why is not None:
        raise ConfigError(f"train.task='attention_transfer' takes a decoder (model.block='transformer', unrolled) "
                          f"trained on whole unpacked rows of a prepared corpus on one device per row; not {why}")
    methods = layer_methods(c.model)
    if all(attention.get_class(m).exact for m in methods):
        raise ConfigError("train.task='attention_transfer': every layer runs exact attention, so no layer has "
                          "anything to transfer; swap a method into some layers (model.attention.pattern=dense,eva)")
    wrapped = [m for m in methods if attention.get_class(m).stack_wrapper(causal=c.model.causal)]
    if wrapped:
        raise ConfigError(f"train.task='attention_transfer': {wrapped[0]!r} runs the blocks in its own "
                          "stack wrapper, which hands no layer's q, k, v to a core that could be compared")


def _sequence_parallel(c) -> bool:
    return c.mesh.sequence > 1


def _composed(c) -> bool:
    """Sequence parallelism by composed states (any mode but 'xla')."""
    return c.mesh.sequence > 1 and c.mesh.sequence_mode != "xla"


def _composed_windows(c) -> bool:
    """Composed sequence parallelism over windows that carry state (the hook takes one state per layer)."""
    return _composed(c) and c.train.window < c.train.seq_len


def _loss_scale_ok(c) -> bool:
    """``train.loss_scale``: 'auto', 'dynamic', 'none' or a finite number > 0."""
    val = str(c.train.loss_scale).strip().lower()
    if val in ("auto", "dynamic", "none"):
        return True
    try:
        return _finite(float(val)) and float(val) > 0
    except ValueError:
        return False


def _check_choices(c) -> None:
    for path, allowed in _CHOICES.items():
        val = _get(c, path)
        if val not in allowed:
            raise ConfigError(f"config {path}={val!r} is not allowed; choose one of: {', '.join(allowed)}")


def _check_registries(c) -> None:
    """Names looked up in a registry: the data source, the tokenizer, the block."""

    if c.data.source not in sources.names():
        raise ConfigError(f"data.source={c.data.source!r} is unknown; allowed: {', '.join(sources.names())}")
    if c.data.tokenizer not in tokenizers.names():
        raise ConfigError(f"data.tokenizer={c.data.tokenizer!r} is unknown; allowed: {', '.join(tokenizers.names())}")
    blocks.get_block(c.model.block)


def _check_model_vocab(c) -> None:
    _check_vocab(c.model)


def _wrapper_takes(c, declaration: str) -> bool:
    """The model's method runs on the plain loop of blocks, or its stack wrapper (for the model's causality: an
    encoder is bidirectional) declares ``declaration`` (``takes_post_norm``, ``takes_grouped_kv``)."""
    name = c.model.attention.name
    if name not in attention.names():
        return True  # an unknown name is refused by its own rule
    wrapper = attention.get_class(name).stack_wrapper(causal=bool(c.model.causal) and c.model.kind != "encoder")
    if not wrapper:
        return True
    module_name, cls_name = wrapper.split(":")
    return bool(getattr(getattr(importlib.import_module(module_name), cls_name), declaration, False))


def _resolve_encoder(c) -> None:
    """An encoder's blocks are bidirectional: ``model.causal`` becomes False."""
    if c.model.kind == "encoder":
        c.model.causal = False


def _pair_ok(pair, low_ok) -> bool:
    lo, hi = (list(pair) + [0, 0])[:2]
    return len(pair) == 2 and low_ok(lo) and lo <= hi


def _fits_rows(seq_len_key: str):
    """A generated source's settings fit rows of ``train.<seq_len_key>`` tokens (its own message)."""
    def check(c) -> None:

        sources.build(c.data).check_rows(c.train[seq_len_key])
    return check


def _check_attention(c) -> None:
    """The attention method(s): known names and keys, ``model.attention.pattern``, each method's
    settings; keeps only the methods the layers run and splits their settings between
    ``model.attention`` (hyperparameters) and ``execution.attention`` (how they run)."""
    m = c.model
    name = m.attention.name
    if name not in attention.names():
        raise ConfigError(f"model.attention.name={name!r} is unknown; allowed: {', '.join(attention.names())}")
    for key in m.attention.keys():
        if key not in ("name", "pattern") and key not in attention.names():
            raise ConfigError(f"config key 'model.attention.{key}' is unknown; allowed: name, pattern, "
                              f"{', '.join(attention.names())}")
    methods = _check_pattern(c)
    for key in c.execution.attention.keys():
        if key not in attention.names():
            raise ConfigError(f"config key 'execution.attention.{key}' is unknown; allowed: {', '.join(attention.names())}")

    if m.remat_policy not in REMAT_POLICIES:
        raise ConfigError(f"model.remat_policy={m.remat_policy!r}: allowed: {', '.join(REMAT_POLICIES)}")

    rotated = any(takes_rotary(n) for n in methods)  # rotary reaches at least one layer
    resolved = {name: _check_method(c, name, rotated=rotated) for name in methods}
    for other in list(m.attention.keys()):
        if other not in ("name", "pattern", *methods):
            del m.attention[other]
    for name, (method_cfg, exec_keys) in resolved.items():
        m.attention[name] = {k: v for k, v in method_cfg.items() if k not in exec_keys}
    for other in c.execution.attention.keys():  # a setting for a method no layer runs is named, not dropped silently
        if other not in methods:
            defaults = attention.execution_config(other)
            changed = [k for k in c.execution.attention[other].keys()
                       if k in defaults and c.execution.attention[other][k] != defaults[k]]
            if changed:
                print(f"warning: execution.attention.{other}.{changed[0]}={c.execution.attention[other][changed[0]]!r}"
                      f" is set but the model's layers run {', '.join(methods)}: it has no effect")
    c.execution.attention = ml_collections.ConfigDict(
        {name: {k: method_cfg[k] for k in exec_keys} for name, (method_cfg, exec_keys) in resolved.items()})


def _resolve_train(c) -> None:
    """``train.window`` 0 -> the whole sequence; learned positions' ``model.max_len`` 0 -> ``train.seq_len``."""
    t = c.train
    if t.window == 0:
        t.window = t.seq_len
    if c.model.positions == "learned" and c.model.max_len == 0:
        c.model.max_len = t.seq_len


def _fit_to_run_length(c) -> None:
    fit_to_run_length(c.train)


def _resolve_pattern(c) -> None:
    """``model.attention.pattern`` given on the command line as ``eva,dense`` (or ``(eva,dense)``) arrives as one
    string: split it into the method names. An empty one (``''``, ``()``) is no pattern."""
    pattern = c.model.attention.pattern
    names = [pattern] if isinstance(pattern, str) else list(pattern) if isinstance(pattern, (tuple, list)) else None
    if names is not None and all(isinstance(p, str) and not p.strip().strip("()[]'\"") for p in names):
        c.model.attention.pattern = ()
        return
    if isinstance(pattern, (tuple, list)) and any(isinstance(p, str) and "," in p for p in pattern):
        text = ",".join(p for p in pattern if isinstance(p, str)).strip().strip("()[]")
        c.model.attention.pattern = tuple(p.strip().strip("'\"") for p in text.split(",") if p.strip())


def attention_label(m) -> str:
    """How logs and ``--check`` name a model's attention (``m``: the ``model`` section): its method, or the
    ``model.attention.pattern`` of a stack of several methods (``eva,dense``)."""
    pattern = tuple(m.attention.pattern)
    return ",".join(pattern) if len(set(pattern)) > 1 else m.attention.name


def exact_attention_notes(c) -> list[str]:
    """A line for each method of a validated config's model that computes exact softmax attention on rows of the
    run's training length (``AttentionCore.exact_len``): its approximation is never trained there."""
    m, n_row = c.model, c.train.seq_len
    out = []
    for name in dict.fromkeys((m.attention.name, *m.attention.pattern)):
        n = attention.get_class(name).exact_len(m.attention[name], causal=m.causal)
        if n and n_row <= n:
            out.append(f"note: {name} computes exact softmax attention on rows of up to {n:,} tokens and this run "
                       f"trains on rows of {n_row:,}: its approximation is not trained (only longer evaluation "
                       f"streams run it); train.seq_len > {n:,} trains it")
    return out


# data keys holding local paths: a relative one that exists (and a relative cache folder) is saved absolute, so
# that the run's saved config reads the same files from any working directory (longctx-eval, longctx-sample)
_PATH_KEYS = (("path",), ("cache_dir",), ("options", "train_path"), ("options", "valid_path"),
              ("options", "test_path"), ("options", "tokenizer_file"))


def _resolve_data_paths(c) -> None:

    for keys in _PATH_KEYS:
        node = c.data
        for k in keys[:-1]:
            node = node.get(k) if hasattr(node, "get") else None
        value = node.get(keys[-1]) if hasattr(node, "get") else None
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)) and "://" not in value \
                and (keys == ("cache_dir",) or os.path.exists(value) or glob.glob(value)):
            node[keys[-1]] = os.path.abspath(value)


def _resolve_eval(c) -> None:
    """The eval keys left at 0 take the training's values."""
    t, e = c.train, c.eval
    if e.window == 0:
        e.window = t.window
    if e.row_len == 0:
        e.row_len = t.seq_len
    if e.context == 0:
        e.context = t.seq_len
    if e.stride == 0:
        e.stride = max(1, e.context // 2)


def _check_mesh_rules(c) -> None:

    sharding_lib.parse_rules(c.mesh.rules)


def _train_modes() -> tuple[str, ...]:

    return TRAIN_MODES


# Every check, in the order they run (the first that fails is reported); the resolving steps fill in the
# keys left at 0 that later rules read. Single keys out of range are in _CHOICES and _RANGES.
_VALIDATION = (
    _check_choices,
    check_ranges,
    _check_registries,
    _resolve_data_paths,
    Rule(_always, _loss_scale_ok,
         "config train.loss_scale={train.loss_scale!r} is not allowed; choose one of: auto, dynamic, none, or a "
         "fixed scale (a number > 0, e.g. '1024')"),
    # the model
    Rule(lambda c: c.model.positions == "rotary", lambda c: c.model.head_dim % 2 == 0,
         "model.positions='rotary' needs an even model.head_dim, got {model.head_dim}"),
    Rule(lambda c: c.model.positions == "sinusoidal", lambda c: c.model.d_model % 2 == 0,
         "model.positions='sinusoidal' needs an even model.d_model, got {model.d_model}"),
    Rule(lambda c: c.model.output == "adaptive", lambda c: not c.model.tie_embeddings,
         "model.output='adaptive' has its own output weights; set model.tie_embeddings=False"),
    Rule(lambda c: c.model.num_kv_heads > 0, lambda c: c.model.num_heads % c.model.num_kv_heads == 0,
         "model.num_kv_heads={model.num_kv_heads} must divide model.num_heads={model.num_heads} (0 = num_heads)"),
    Rule(lambda c: c.model.block != "transformer",
         lambda c: (c.model.num_kv_heads in (0, c.model.num_heads) and c.model.mlp == "gelu" and c.model.mlp_bias
                    and not c.model.qkv_bias and not c.model.out_bias and c.model.rope_theta == 10000.0),
         "model.block={model.block!r} has its own projections: model.num_kv_heads, mlp, mlp_bias, qkv_bias, out_bias "
         "and rope_theta apply to model.block='transformer'; leave them at their defaults"),
    Rule(lambda c: not _wrapper_takes(c, "takes_grouped_kv"),
         lambda c: c.model.num_kv_heads in (0, c.model.num_heads) and c.model.rope_theta == 10000.0,
         "model.attention.name={model.attention.name!r} runs the blocks in its own stack wrapper, which takes neither "
         "grouped-query attention nor another rotary base; leave model.num_kv_heads=0 and model.rope_theta=10000"),
    Rule(lambda c: c.model.post_norm, lambda c: c.model.block == "transformer" and _wrapper_takes(c, "takes_post_norm"),
         "model.post_norm=True applies to model.block='transformer' with a method that runs on the plain loop of "
         "blocks or in a stack wrapper that takes post-norm blocks (VCC's encoder stack) (model.block="
         "{model.block!r}, model.attention.name={model.attention.name!r}, model.kind={model.kind!r})"),
    Rule(lambda c: c.model.position_offset > 0, lambda c: c.model.positions == "learned",
         "model.position_offset={model.position_offset} applies to learned positions; model.positions is "
         "{model.positions!r}"),
    Rule(lambda c: c.model.head_transform or c.model.head_bias, lambda c: c.model.output == "dense",
         "model.head_transform and model.head_bias apply to model.output='dense' (the adaptive softmax has its own "
         "head)"),
    _check_model_vocab,
    # a masked-LM encoder
    _resolve_encoder,
    Rule(_encoder, lambda c: c.train.window in (0, c.train.seq_len),
         "train.window={train.window}: windows do not apply to encoders (model.kind='encoder' sees the whole row); "
         "leave train.window=0"),
    Rule(_encoder, lambda c: c.eval.protocol != "sliding",
         "eval.protocol='sliding' is for decoders; an encoder is scored on a fixed masking of rows of eval.context "
         "tokens (leave eval.protocol at its default)"),
    Rule(_encoder, lambda c: not (c.mlm.mask_prob < 0 or c.mlm.random_prob < 0
                                  or c.mlm.mask_prob + c.mlm.random_prob > 1.0),
         "mlm.mask_prob={mlm.mask_prob} and mlm.random_prob={mlm.random_prob} must be >= 0 with a sum of at most 1"),
    Rule(_encoder, lambda c: _pair_ok(c.mlm.clusters, lambda lo: 1 <= lo),
         lambda c: f"mlm.clusters={tuple(c.mlm.clusters)} must be (low, high) with 1 <= low <= high"),
    Rule(_encoder, lambda c: _pair_ok(c.mlm.cluster_sigma, lambda lo: 0 < lo),
         lambda c: f"mlm.cluster_sigma={tuple(c.mlm.cluster_sigma)} must be (low, high) with 0 < low <= high"),
    # a generated recall task
    Rule(_generated, lambda c: not _encoder(c),
         "data.source={data.source!r} is a causal recall task; it needs model.kind='decoder'"),
    Rule(_generated, lambda c: c.data.tokenizer == "bytes",
         "data.source={data.source!r} generates byte ids; set data.tokenizer='bytes'"),
    Rule(_generated, lambda c: len(c.data.synthetic.distance) == 2 and not min(c.data.synthetic.distance) < 0,
         lambda c: f"data.synthetic.distance={tuple(c.data.synthetic.distance)} must be (lo, hi) with 0 meaning "
                   "the shortest / longest distance that fits"),
    Rule(_generated, lambda c: c.data.synthetic.eval_rows > 0 and c.data.synthetic.bins > 0,
         "data.synthetic.eval_rows and data.synthetic.bins must be positive integers"),
    When(_generated, _fits_rows("seq_len")),
    # attention
    _resolve_pattern,
    _check_attention,
    _check_packing,
    _check_transfer,
    # the training run
    _resolve_train,
    Rule(_always, lambda c: c.train.seq_len % c.train.window == 0,
         lambda c: f"train.window={c.train.window} must divide train.seq_len={c.train.seq_len} "
                   f"(e.g. {c.train.seq_len // 4}); 0 means the whole sequence"),
    Rule(_always, lambda c: c.train.batch_size % c.train.microbatches == 0,
         "train.microbatches={train.microbatches} must divide train.batch_size={train.batch_size} (each update's "
         "rows are split into that many equal micro-batches)"),
    Rule(_encoder, lambda c: c.train.microbatches == 1,
         "train.microbatches > 1 (gradient accumulation) is for decoders; an encoder (masked LM) trains on the whole "
         "batch: leave train.microbatches=1"),
    Rule(lambda c: c.train.short_steps <= 0, lambda c: c.train.steps % n_windows(c) == 0,
         lambda c: f"train.steps={c.train.steps} counts optimizer updates and must be a multiple of "
                   f"seq_len/window={n_windows(c)}"),
    _fit_to_run_length,
    # staged training (train.short_steps > 0)
    Rule(lambda c: c.train.short_steps > 0, lambda c: c.train.short_steps < c.train.steps,
         "train.short_steps={train.short_steps} must be in [0, train.steps={train.steps}) (0 = off)"),
    Rule(lambda c: c.train.short_steps > 0, lambda c: 0 < c.train.short_seq_len < c.train.seq_len,
         "train.short_seq_len={train.short_seq_len} must be in (0, train.seq_len={train.seq_len}) "
         "when train.short_steps > 0"),
    Rule(lambda c: c.train.short_steps > 0, lambda c: not _encoder(c),
         "train.short_steps (staged training) is for decoders; an encoder trains on one row length"),
    Rule(lambda c: c.train.short_steps > 0 and n_windows(c) > 1, lambda c: c.train.short_seq_len % c.train.window == 0,
         "train.short_seq_len={train.short_seq_len} must be a multiple of train.window={train.window} (the short "
         "rows are trained in the same windows)"),
    Rule(lambda c: c.train.short_steps > 0, lambda c: c.train.short_steps % short_windows(c.train) == 0,
         lambda c: f"train.short_steps={c.train.short_steps} counts updates and must be a multiple of "
                   f"short_seq_len/window={short_windows(c.train)}"),
    Rule(lambda c: c.train.short_steps > 0, lambda c: (c.train.steps - c.train.short_steps) % n_windows(c) == 0,
         lambda c: f"train.steps - train.short_steps = {c.train.steps - c.train.short_steps} updates on rows of "
                   f"train.seq_len must be a multiple of seq_len/window={n_windows(c)}"),
    Rule(lambda c: c.train.short_steps > 0 and _sequence_parallel(c), lambda c: c.train.short_seq_len % c.mesh.sequence == 0,
         "mesh.sequence={mesh.sequence} must divide train.short_seq_len={train.short_seq_len}"),
    When(lambda c: c.train.short_steps > 0 and _generated(c), _fits_rows("short_seq_len")),
    Rule(lambda c: c.model.positions == "learned", lambda c: c.model.max_len >= c.train.seq_len,
         "model.max_len={model.max_len} is shorter than train.seq_len={train.seq_len} (learned positions)"),
    Rule(_always, lambda c: 0 <= c.train.warmup_steps < c.train.steps,
         "train.warmup_steps={train.warmup_steps} must be in [0, train.steps={train.steps})"),
    # evaluation
    _resolve_eval,
    Rule(_always, lambda c: c.eval.stride <= c.eval.context,
         "eval.stride={eval.stride} must be at most eval.context={eval.context}"),
    Rule(lambda c: c.eval.protocol == "stream" and not _encoder(c), lambda c: c.model.causal,
         "eval.protocol='stream' needs a causal model (model.causal=True)"),
    Rule(_always, lambda c: c.eval.max_tokens == 0 or c.eval.max_bytes == 0,
         "eval.max_tokens={eval.max_tokens} and eval.max_bytes={eval.max_bytes}: give one budget and set the other "
         "to 0"),
    Rule(_encoder, lambda c: c.eval.max_bytes == 0,
         "eval.max_bytes={eval.max_bytes} is for decoders: an encoder is scored on whole rows of tokens; set "
         "eval.max_bytes=0 and limit the rows with eval.max_tokens"),
    # the device mesh and sequence parallelism
    _check_mesh_rules,
    Rule(_always, lambda c: c.mesh.sequence_mode in _train_modes(),
         lambda c: f"mesh.sequence_mode={c.mesh.sequence_mode!r}; allowed: {', '.join(_train_modes())}"),
    Rule(_encoder, lambda c: c.mesh.sequence_mode != "compose",
         "mesh.sequence_mode='compose' composes carried (causal) states; an encoder has none: use auto or xla"),
    Rule(_composed, lambda c: not c.model.remat,
         "model.remat=True with mesh.sequence={mesh.sequence} needs mesh.sequence_mode='xla' (composed prefix states "
         "pass through the blocks as objects the recomputation cannot take); or set model.remat=False"),
    Rule(_composed_windows, lambda c: not scans_layers(c.model),
         "model.scan_layers='on' with mesh.sequence={mesh.sequence} and windows carrying state needs "
         "mesh.sequence_mode='xla' (the composed hook takes one state per layer, not a stacked one)"),
    Rule(_sequence_parallel, lambda c: c.train.window % c.mesh.sequence == 0,
         "mesh.sequence={mesh.sequence} must divide the training window ({train.window} tokens)"),
)


def validate(cfg: ml_collections.ConfigDict, platform: str | None = None) -> ml_collections.ConfigDict:
    """Check keys, types, values and combinations; return a resolved frozen copy. The checks are the
    rows of :data:`_VALIDATION`, run in order on a copy; then ``model.scan_layers='auto'`` is resolved for
    ``platform`` (a kernel platform name, 'cpu' | 'cuda' | 'rocm' | 'tpu'; default
    :func:`longctx.attention.dispatch.current_platform`), :func:`_resolve_scan_layers`."""
    check_against_base(cfg)
    c = ml_collections.ConfigDict(cfg.to_dict())
    for check in _VALIDATION:
        check(c)
    _resolve_scan_layers(c, platform)
    c.lock()
    return c


# model.scan_layers='auto' on a CPU ('on' | 'off'): what the previous main job's model trains faster with on XLA:CPU, measured
# on a 2-core CPU shared with other jobs, processes alternated on, off, off, on:
#   for v in on off off on; do longctx-bench step --config configs/main_transformer_vq.py --lengths 1k --window 256 --batch_size 8 \
#     --repeats 15 --matmul_n 0 --noprogress --config.model.scan_layers=$v; done
# median step 1.28, 2.33 s scanned against 1.06, 1.21 s unrolled; compile 7.9, 9.8 s against 8.4, 9.9 s (four
# layers: no compile-time gain to weigh). Over 18 such runs (load average 1 to 16) the scanned step also took more
# CPU time per step in every round. So 'off'.
CPU_SCAN_LAYERS = "off"


def _scan_applies(c) -> bool:
    """Whether the layers of ``c`` (checked by :data:`_VALIDATION`) can run under one scan: every layer runs the same
    method, which runs on the plain loop of blocks (no stack wrapper), the task is not attention transfer and no
    composed sequence parallelism carries state over windows: the cases an explicit 'on' is refused for."""
    methods = set(layer_methods(c.model))
    return (len(methods) == 1 and not any(attention.get_class(n).stack_wrapper(causal=c.model.causal) for n in methods)
            and not _transfer(c) and not _composed_windows(c))


def _resolve_scan_layers(c, platform: str | None) -> None:
    """``model.scan_layers='auto'`` -> 'on' where the scan applies (:func:`_scan_applies`) on a GPU / TPU, or on a
    CPU where :data:`CPU_SCAN_LAYERS` says so; else 'off'."""
    if c.model.scan_layers != "auto":
        return
    on = _scan_applies(c)
    if on:
        platform = dispatch.current_platform() if platform is None else platform
        on = platform != "cpu" or CPU_SCAN_LAYERS == "on"
    c.model.scan_layers = "on" if on else "off"


def _check_pattern(c) -> tuple[str, ...]:
    """``model.attention.pattern``'s rules; the distinct methods the layers run (``model.attention.name`` first)."""
    m = c.model
    name, pattern = m.attention.name, m.attention.pattern
    if not pattern:
        return (name,)
    if not isinstance(pattern, (tuple, list)) or not all(isinstance(p, str) for p in pattern):
        raise ConfigError(f"model.attention.pattern={pattern!r} must be a tuple of method names, e.g. "
                          "(three efficient layers, then 'dense'); () = every layer runs model.attention.name")

    per_layer = layer_methods(m)  # unknown names, a length that does not fit num_layers
    if name not in pattern:
        raise ConfigError(f"model.attention.name={name!r} is not in model.attention.pattern={tuple(pattern)}; set it "
                          "to one of the pattern's methods (the one logs and reports name)")
    check_layers(m, per_layer, scans_layers(m))
    if c.mesh.sequence > 1 and len(set(per_layer)) > 1:
        raise ConfigError(f"mesh.sequence={c.mesh.sequence} with a pattern of different methods is not supported yet; "
                          "set mesh.sequence=1")
    return tuple(dict.fromkeys((name, *per_layer)))


def _check_method(c, name: str, *, rotated: bool = False):
    """One attention method's settings as a layer runs them: (its merged config, its execution keys).
    ``rotated``: some layer of the model takes rotary; then a method that takes none runs its layers unrotated
    (rotary is applied per layer, ``longctx.models.blocks.takes_rotary``); a model none of whose layers takes it
    is refused."""
    m = c.model
    allowed_pos = attention.get_class(name).allowed_positions
    if allowed_pos is not None and m.positions not in allowed_pos and not (m.positions == "rotary" and rotated):
        raise ConfigError(
            f"model.positions={m.positions!r} is not supported with attention {name!r}; allowed: {', '.join(allowed_pos)}"
            + (" (or rotary in a model.attention.pattern whose other layers take it)" if m.positions == "rotary" else "")
            + f": add --config.model.positions={allowed_pos[0]}"
        )
    method_cfg = attention.default_config(name)
    method_cfg.update(c.execution.attention[name].to_dict() if name in c.execution.attention else {})
    method_cfg.update(m.attention[name].to_dict() if name in m.attention else {})
    exec_keys = attention.execution_keys(name)
    for key in (m.attention[name].keys() if name in m.attention else ()):
        if key in exec_keys:
            raise ConfigError(f"config key 'model.attention.{name}.{key}' is an execution setting: set "
                              f"execution.attention.{name}.{key}")
    for key in (c.execution.attention[name].keys() if name in c.execution.attention else ()):
        if key not in exec_keys:
            where = "model.attention" if key in attention.default_config(name) else None
            raise ConfigError(f"config key 'execution.attention.{name}.{key}' is unknown"
                              + (f": it is a hyperparameter, set it under {where}.{name}.{key}" if where else
                                 f"; allowed: {', '.join(exec_keys) or '(none)'}"))
    method_cfg = attention.get_class(name).resolve_for_run(method_cfg, seq_len=c.train.seq_len)
    attention.validate(name, method_cfg, causal=m.causal, prefix=f"model.attention.{name}")
    if m.remat and attention.get_class(name).stack_wrapper(causal=m.causal):
        raise ConfigError(f"model.remat=True: attention {name!r} runs the blocks inside its own stack wrapper, which "
                          "the per-block remat cannot wrap; set model.remat=False")
    if scans_layers(m) and attention.get_class(name).stack_wrapper(causal=m.causal):
        raise ConfigError(f"model.scan_layers='on': attention {name!r} runs the blocks inside its own stack wrapper, "
                          "which a scan over stacked layers cannot replace; set model.scan_layers='off' or 'auto'")
    return method_cfg, exec_keys


def fit_to_run_length(t, *, say=print) -> list[str]:
    """A short run needs no extra overrides: a warm-up at least as long as the run becomes a tenth of
    it, a staged phase (``train.short_steps``) at least as long as the run its first half, and log / eval /
    checkpoint intervals longer than the run become the run's length (the run still evaluates and
    checkpoints at its end). Changes ``t`` (the ``train`` section) in place and says so in one line."""
    changed = []
    if t.warmup_steps >= t.steps > 0:
        changed.append(f"train.warmup_steps {t.warmup_steps} -> {t.steps // 10}")
        t.warmup_steps = t.steps // 10
    if t.short_steps >= t.steps > 0:
        half = t.steps // 2 // max(1, short_windows(t)) * max(1, short_windows(t))  # whole short rows
        changed.append(f"train.short_steps {t.short_steps} -> {half}")
        t.short_steps = half
    for key in ("log_every", "eval_every", "ckpt_every"):
        if t[key] > t.steps > 0:
            changed.append(f"train.{key} {t[key]} -> {t.steps}")
            t[key] = t.steps
    if changed:
        say(f"note: fitted to the run's length, train.steps={t.steps}: {', '.join(changed)}")
    return changed


def _check_vocab(m) -> None:
    """The rules that involve the vocabulary size (skipped while it is 0, i.e. not known yet)."""
    if m.output == "adaptive":
        cuts = list(m.adaptive_cutoffs)
        if not cuts or cuts != sorted(set(cuts)) or cuts[0] <= 0 or (m.vocab_size and cuts[-1] >= m.vocab_size):
            raise ConfigError(
                f"model.adaptive_cutoffs={tuple(cuts)} must be strictly increasing, positive and below the vocabulary size"
                + (f" {m.vocab_size}" if m.vocab_size else "")
            )


def resolve_vocab(cfg: ml_collections.ConfigDict, vocab_size: int,
                  mask_token: int | None = None) -> ml_collections.ConfigDict:
    """A validated config with ``model.vocab_size`` filled in from the tokenizer (0 -> ``vocab_size``).

    An encoder's mask token (``mlm.mask_id``; -1 picks it): one id beyond the tokenizer's vocabulary, or the
    tokenizer's own mask token ``mask_token`` (its ``<mask>`` / ``[MASK]``, :func:`longctx.data.masking.own_mask_id`)
    where ``model.vocab_size`` leaves no id beyond the vocabulary (an imported BERT or RoBERTa, whose vocabulary
    is its tokenizer's), wherever it is in the vocabulary (RoBERTa's ``<mask>`` is its last id, BERT's ``[MASK]``
    103 of 30522): random replacement tokens are drawn from the tokenizer's vocabulary less its special ids
    (:func:`longctx.data.masking.replacement_ids`).

    Checks only the rules that involve the vocabulary; the rest was checked by :func:`validate`,
    which runs once on the way into training."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    own = mask_token is not None and 0 <= mask_token < vocab_size
    if cfg.model.kind == "encoder":
        if cfg.mlm.mask_id == -1:
            room = cfg.model.vocab_size == 0 or cfg.model.vocab_size > vocab_size  # an id beyond the vocabulary
            cfg.mlm.mask_id = int(mask_token) if own and not room else int(vocab_size)
        if not (own and cfg.mlm.mask_id == mask_token):
            if cfg.model.vocab_size == 0:
                cfg.model.vocab_size = cfg.mlm.mask_id + 1
            if not vocab_size <= cfg.mlm.mask_id < cfg.model.vocab_size:
                own_text = f"the tokenizer's own mask token {mask_token}, or " if own else ""
                raise ConfigError(f"mlm.mask_id={cfg.mlm.mask_id} must be {own_text}at least the tokenizer's "
                                  f"vocabulary size {vocab_size} and below model.vocab_size={cfg.model.vocab_size} "
                                  f"(-1: {vocab_size}, or the tokenizer's own <mask> / [MASK] where model.vocab_size "
                                  "leaves no id beyond its vocabulary)")
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = int(vocab_size)
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size} "
                          f"(data.tokenizer={cfg.data.tokenizer!r}); set model.vocab_size=0 to take the tokenizer's")
    _check_vocab(cfg.model)
    cfg.lock()
    return cfg


def parse_value(text: str, like):
    """``text`` as the type of ``like`` (bool, int, float or str)."""
    if isinstance(like, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"expected true/false, got {text!r}")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    return text


BUDGETS = ("eval.max_tokens", "eval.max_bytes")


def one_budget(overrides: dict | None) -> dict:
    """``overrides`` with a scoring budget given alone replacing the run's other one (set to 0): a run trained
    with ``eval.max_bytes`` scored with ``eval.max_tokens=N`` scores N tokens. Both given: as given (validation
    refuses two budgets > 0)."""
    over = dict(overrides or {})
    given = [k for k in BUDGETS if k in over]
    if len(given) == 1 and over[given[0]]:
        over.setdefault(BUDGETS[1 - BUDGETS.index(given[0])], 0)
    return over


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: list[str], *, allowed_sections=("eval", "sample")):
    """A copy of ``cfg`` with ``section.key=value`` strings applied (``longctx-bench --config.section.key=value``)."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.split(".")
        if parts[0] not in allowed_sections:
            raise ConfigError(f"override {path}: only {', '.join(allowed_sections)} settings can be changed here")
        node = cfg
        for p in parts[:-1]:
            if p not in node:
                raise ConfigError(f"override {path}: unknown section {p!r}; allowed: {', '.join(sorted(node.keys()))}")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(f"override {path}: unknown key; allowed: {', '.join(sorted(node.keys()))}")
        try:
            node[parts[-1]] = parse_value(text, node[parts[-1]])
        except ValueError as e:
            raise ConfigError(f"override {path}={text!r}: {e}") from None
    return cfg


def merge_over_base(saved: ml_collections.ConfigDict | dict) -> ml_collections.ConfigDict:
    """A config given as a (possibly partial) dict or ConfigDict, merged over the base config so that validation
    sees every key (a converter's or a benchmark's config names only what differs from the base)."""

    merged = json.loads(base_config().to_json())
    saved = json.loads(saved.to_json()) if isinstance(saved, ml_collections.ConfigDict) else saved

    def deep(dst, src):
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                deep(dst[k], v)
            else:
                dst[k] = v

    deep(merged, saved)
    return ml_collections.ConfigDict(merged)


def n_windows(cfg) -> int:
    """Updates per row of ``train.seq_len`` (its windows)."""
    return cfg.train.seq_len // cfg.train.window


def short_windows(t) -> int:
    """Updates per row of staged training's short phase (``t``: the ``train`` section): one where every row is
    trained whole (``train.window = train.seq_len``), else the short row's windows of ``train.window``."""
    if t.short_steps <= 0:
        return 0
    return 1 if t.window in (0, t.seq_len) else max(1, t.short_seq_len // t.window)


def windows_at(cfg, step: int) -> int:
    """Updates of the train step that starts at update ``step`` (the windows of its row)."""
    t = cfg.train
    return short_windows(t) if step < t.short_steps else n_windows(cfg)


def batch_index(cfg, step: int) -> int:
    """Which batch of rows the train step starting at update ``step`` reads: rows are drawn per index, the short
    phase's rows (``train.short_steps``) from rows of ``train.short_seq_len``, then the long phase's."""
    t = cfg.train
    if t.short_steps <= 0:
        return step // n_windows(cfg)
    if step < t.short_steps:
        return step // short_windows(t)
    return t.short_steps // short_windows(t) + (step - t.short_steps) // n_windows(cfg)


def update_tokens(cfg, step: int) -> int:
    """Tokens a row contributes to the update at ``step``: its window (the whole short row in a full-row short
    phase)."""
    t = cfg.train
    return t.short_seq_len // short_windows(t) if step < t.short_steps else t.window
