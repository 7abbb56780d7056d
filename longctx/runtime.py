"""A trained model ready to run: built from a config, restored from a workdir's newest valid
checkpoint, with a jitted deterministic forward. Used by ``longctx-eval``, ``longctx-sample``
and the benchmarks; the command-line plumbing lives in :mod:`longctx.cli`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx

from longctx import attention
from longctx import config as config_lib
from longctx.attention import dispatch
from longctx.config import apply_overrides  # noqa: F401 -- re-exported for longctx.bench.configs
from longctx.data import tokenizers
from longctx.data.masking import num_masked
from longctx.data.prepare import prepare
from longctx.errors import CheckpointError, ConfigError
from longctx.models.decoder import build_model
from longctx.protocols import split_word_count
from longctx.train import checkpoint
from longctx.train.step import jit_forward, make_forward, make_mlm_forward, split_model

# what --config.KEY=VALUE may change when a trained run is evaluated or sampled
# the layer layout may change too: a checkpoint restores into either (checkpoint._saved_layout), and tools that
# walk the blocks one by one (capture, dropin) ask for the unrolled stack
RUN_OVERRIDABLE = ("eval.", "sample.", "data.path", "data.cache_dir", "model.scan_layers")
# FMA's levels are parameters built for its max_len; a window past it adds none (the layer's own option for
# streaming past the training length), so a trained run may take it for evaluation and sampling
TRUNCATED_WINDOW_KEYS = ("model.attention.fma.allow_truncated_window", "model.attention.fma_linear.allow_truncated_window")
# exact attention over every key and over a sliding window (the methods that declare ``exact`` or
# ``sliding_window``) share every parameter: a run trained with one is scored with the other (exact attention over
# a window of its trained length, a sliding-window run with every key)
WINDOW_SWAP = tuple(n for n in attention.names()
                    if attention.get_class(n).exact or attention.get_class(n).sliding_window)
SLIDING = next(n for n in WINDOW_SWAP if attention.get_class(n).sliding_window)  # the method with the window
WINDOW_KEYS = ("model.attention.name", f"model.attention.{SLIDING}.window")


def check_run_overrides(overrides: dict) -> None:
    for path, value in overrides.items():
        if path == "model.attention.name" and value not in WINDOW_SWAP:
            raise ConfigError(f"--config.model.attention.name={value}: a trained run's method changes only between "
                              f"{' and '.join(WINDOW_SWAP)} (they share every parameter)")
        if not path.startswith(RUN_OVERRIDABLE) and path not in WINDOW_KEYS + TRUNCATED_WINDOW_KEYS:
            raise ConfigError(
                f"--config.{path}: a trained run's model, data and training settings are fixed; "
                "allowed here: --config.eval.*, --config.sample.*, --config.data.path, --config.data.cache_dir, "
                "--config.model.scan_layers, --config.model.attention.<fma|fma_linear>.allow_truncated_window, "
                "and between dense and swa --config.model.attention.name and --config.model.attention.swa.window"
            )


def _check_window_swap(saved, overrides: dict) -> None:
    """A run's method changes only from dense or swa in every layer (``model.attention.name``)."""
    if "model.attention.name" not in overrides:
        return
    att = saved.model.attention
    methods = tuple(att.pattern) or (att.name,)
    if any(m not in WINDOW_SWAP for m in methods):
        raise ConfigError(f"--config.model.attention.name={overrides['model.attention.name']}: this run's attention "
                          f"is {','.join(methods)}; only a dense or swa run is scored with the other")
    if att.pattern:
        raise ConfigError("--config.model.attention.name: this run mixes methods by layer "
                          f"(model.attention.pattern={','.join(att.pattern)}); only a single-method run changes method")


def run_config(saved, overrides: dict):
    """A trained run's config (``saved``: the dict it was saved as) with ``overrides`` (checked by
    :func:`check_run_overrides`) applied, validated once: what a command that reads the run computes with."""
    cfg = config_lib.merge_over_base(saved)
    _check_window_swap(cfg, overrides)
    trained_every_key = not attention.get_class(cfg.model.attention.name).sliding_window
    for path, value in overrides.items():
        node = cfg
        *parents, key = path.split(".")
        for p in parents:
            node = node[p]
        node[key] = value
    if trained_every_key and overrides.get("model.attention.name") == SLIDING and WINDOW_KEYS[1] not in overrides:
        cfg.model.attention[SLIDING].window = cfg.train.seq_len  # an exact run's window: its trained length
    return config_lib.validate(cfg)


def check_run(workdir, overrides: dict) -> str:
    """What ``--check`` of a command that reads a trained run can say without restoring it: the overrides name keys
    it may change, and where the run exists, its saved config (``WORKDIR/config.json``) with the overrides
    validates. Returns what was checked, for the ``ok`` line (a run not trained yet: the keys only)."""
    check_run_overrides(overrides)
    wd = Path(workdir)
    if not wd.exists():
        return "the override keys (no run there yet: train it first, and its config is checked too)"
    saved = wd / "config.json"
    if not saved.is_file():
        raise CheckpointError(f"{wd} holds no config.json: not a run longctx-train wrote (or it is still starting)")
    try:
        cfg = json.loads(saved.read_text())
    except ValueError as e:
        raise CheckpointError(f"{saved} is not valid JSON ({e})") from None
    run_config(cfg, overrides)
    return "its saved config with the overrides"


class Runner:
    """A model with its parameters and a jitted deterministic forward."""

    def __init__(self, cfg, graphdef, params, nongrad, rest, *, tokenizer=None, step: int = 0):
        self.cfg, self.graphdef, self.step = cfg, graphdef, step
        self.params = (params, nongrad, rest)
        self.tokenizer = tokenizer
        # data.cache_dir read from a checkpoint is not the user's word: never written to (data/prepare.py)
        self.trust_cache_dir = True
        if cfg.model.kind == "encoder":
            # forward(params, inputs, targets, mask) -> (nll, correct, valid, idx) at the masked positions

            self.num_masked = num_masked(cfg.eval.context, cfg.mlm.rate)
            fwd = jax.jit(make_mlm_forward(graphdef, self.num_masked))
            self.forward = lambda p, inputs, targets, mask: fwd(*p, inputs, targets, mask)
        else:
            fwd = jit_forward(make_forward(graphdef))  # the state donated: each call hands on the one it returns
            self.forward = lambda p, inputs, targets, state: fwd(*p, inputs, targets, state)

    @property
    def is_encoder(self) -> bool:
        return self.cfg.model.kind == "encoder"

    @property
    def tokenizer_is_bytes(self) -> bool:
        return bool(getattr(self.tokenizer, "one_token_per_byte", False))

    def model(self):
        return nnx.merge(self.graphdef, *self.params)

    def init_state(self, batch_size: int, max_len: int):
        return self.model().init_state(batch_size, max_len)

    def load_split(self, split: str, *, progress: bool = True):
        tok, data, _ = prepare(self.cfg.data, [split], progress=progress, trust_cache_dir=self.trust_cache_dir)
        self.tokenizer = self.tokenizer or tok
        return data[split]

    def load_tokenizer(self, *, progress: bool = True):
        """The run's tokenizer. A tokenizer file (``data.tokenizer='hf'``: an imported model's) is read as it is, no
        corpus needed (sampling an import); one learned from or tied to the data comes from preparing it."""
        if self.tokenizer is None and self.cfg.data.tokenizer == "hf":
            self.tokenizer = tokenizers.build("hf", **tokenizers.cache_kwargs("hf", self.cfg.data))
        if self.tokenizer is None:
            self.tokenizer, _, _ = prepare(self.cfg.data, [self.cfg.eval.split], progress=progress,
                                           trust_cache_dir=self.trust_cache_dir)
        return self.tokenizer

    def word_count(self, data) -> int | None:
        return split_word_count(data)

    @classmethod
    def from_workdir(cls, workdir, *, step=None, overrides: dict | None = None):
        """Restore the newest valid checkpoint of ``workdir`` (or ``step``). ``overrides``:
        ``{'eval.protocol': 'sliding', ...}`` applied to the run's saved config (see
        :data:`RUN_OVERRIDABLE`); the result is validated once."""
        wd = Path(workdir)
        if not wd.exists():
            raise CheckpointError(f"workdir {wd} does not exist: train first (longctx-train --workdir {wd})")
        overrides = dict(overrides or {})
        check_run_overrides(overrides)
        mngr = checkpoint.manager(wd, create=False)
        built = {}

        def target(meta):
            cfg = run_config(meta["config"], overrides)
            model = nnx.eval_shape(lambda: build_model(cfg.model, seed=cfg.train.seed, execution=cfg.execution))
            built["cfg"] = cfg
            built["split"] = split_model(model)
            _, params, nongrad, _ = built["split"]
            return {"params": params, "nongrad": nongrad}

        try:
            tree, meta = checkpoint.restore(mngr, target, step, partial=True)
        finally:
            mngr.close()
        cfg = built["cfg"]
        attention.check_execution(cfg, dispatch.current_platform())  # before any compile
        graphdef, _, _, rest = built["split"]

        tok = tokenizers.build(cfg.data.tokenizer) if cfg.data.tokenizer == "bytes" else None
        runner = cls(cfg, graphdef, tree["params"], tree["nongrad"], rest, tokenizer=tok, step=meta["step"])
        runner.trust_cache_dir = "data.cache_dir" in overrides
        return runner
