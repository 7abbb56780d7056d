"""Shared plumbing of the entry points: building a model from a config, loading a
run from its workdir, one-line user errors."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import jax
import ml_collections
from flax import nnx

from longctx import config as config_lib
from longctx.errors import CheckpointError, ConfigError, LongctxError
from longctx.models.decoder import build_model
from longctx.train import checkpoint
from longctx.train.step import make_forward, split_model


@contextlib.contextmanager
def user_errors():
    """Turn framework errors into one line on stderr and exit status 2."""
    try:
        yield
    except LongctxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_value(text: str, like):
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


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: list[str], *, allowed_sections=("eval", "sample")):
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
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(f"override {path}: unknown key; allowed: {', '.join(sorted(node.keys()))}")
        try:
            node[parts[-1]] = parse_value(text, node[parts[-1]])
        except ValueError as e:
            raise ConfigError(f"override {path}={text!r}: {e}") from None
    return cfg


def resolve_vocab(cfg: ml_collections.ConfigDict, vocab_size: int) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = int(vocab_size)
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return cfg


class Runner:
    """A model with its parameters and a jitted deterministic forward."""

    def __init__(self, cfg, graphdef, params, nongrad, rest, *, tokenizer=None, step: int = 0):
        self.cfg, self.graphdef, self.step = cfg, graphdef, step
        self.params = (params, nongrad, rest)
        self.tokenizer = tokenizer
        fwd = jax.jit(make_forward(graphdef))
        self.forward = lambda p, inputs, targets, state: fwd(*p, inputs, targets, state)

    @property
    def tokenizer_is_bytes(self) -> bool:
        return bool(getattr(self.tokenizer, "one_token_per_byte", False))

    def model(self):
        return nnx.merge(self.graphdef, *self.params)

    def init_state(self, batch_size: int, max_len: int):
        return self.model().init_state(batch_size, max_len)

    def load_split(self, split: str):
        from longctx.data.prepare import prepare

        tok, data, _ = prepare(self.cfg.data, [split])
        self.tokenizer = self.tokenizer or tok
        return data[split]

    def word_count(self, data) -> int | None:
        counts = data.manifest.get("source", {}).get("word_counts") or {}
        return counts.get(data.manifest["split"])

    @classmethod
    def from_workdir(cls, workdir, *, step=None, overrides=()):
        wd = Path(workdir)
        if not wd.exists():
            raise CheckpointError(f"workdir {wd} does not exist: train first (longctx-train --workdir {wd})")
        mngr = checkpoint.manager(wd, create=False)
        meta = checkpoint.read_meta(mngr, step)
        cfg = ml_collections.ConfigDict(meta["config"])
        cfg = apply_overrides(cfg, list(overrides))
        cfg = config_lib.validate(cfg_unlocked_base(cfg))
        model = nnx.eval_shape(lambda: build_model(cfg.model, seed=cfg.train.seed))
        graphdef, params, nongrad, rest = split_model(model)
        tree, meta = checkpoint.restore(mngr, {"params": params, "nongrad": nongrad}, step, partial=True)
        from longctx.data import tokenizers

        tok = tokenizers.build(cfg.data.tokenizer) if cfg.data.tokenizer == "bytes" else None
        runner = cls(cfg, graphdef, tree["params"], tree["nongrad"], rest, tokenizer=tok, step=meta["step"])
        mngr.close()
        return runner


def cfg_unlocked_base(saved: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A saved (resolved) config merged over the current base, so validation sees every key."""
    base = config_lib.base_config()
    merged = json.loads(base.to_json())

    def deep(dst, src):
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                deep(dst[k], v)
            else:
                dst[k] = v

    deep(merged, json.loads(saved.to_json()))
    return ml_collections.ConfigDict(merged)


def format_eval(res: dict) -> str:
    p = res["protocol"]
    lines = [f"{res.get('split', '?')} @ step {res.get('step', '?')}: {res['tokens_scored']:,} tokens scored ({p})"]
    if "bits_per_byte" in res:
        lines.append(f"  bits per byte   {res['bits_per_byte']:.4f}")
    lines.append(f"  bits per token  {res['bits_per_token']:.4f}   token perplexity {res['token_perplexity']:.3f}")
    if "word_perplexity" in res:
        lines.append(f"  word perplexity {res['word_perplexity']:.3f}  ({res['word_count']:,} words, {res['tokens_per_word']:.3f} tokens/word)")
    for name, bpb in res.get("compressors_bits_per_byte", {}).items():
        lines.append(f"  {name:<8} {bpb:.4f} bits per byte on the same bytes")
    return "\n".join(lines)
