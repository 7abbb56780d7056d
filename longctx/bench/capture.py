"""q/k/v of a trained model's layer, for the quality benchmark.

Runs the model's blocks before ``layer`` whole, then ``block.project`` of block ``layer``:
the q, k, v the block hands its attention core (any block type)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from longctx import attention
from longctx.bench import configs


def has_checkpoint(workdir: str | Path) -> bool:
    d = Path(workdir) / "checkpoints"
    return d.exists() and any(p.name.isdigit() for p in d.iterdir())


def exact_method() -> str:
    """The registered method that computes exact softmax attention (asked by capability)."""

    return next(n for n in attention.names() if attention.get_class(n).exact)


def tiny_dense_config(steps: int, sets: list[str] | None = None):
    """configs/default.py (dense attention) with ``steps`` steps, eval/checkpoint at the end only."""
    cfg = configs.default_config()
    cfg.model.attention.name = exact_method()
    cfg.train.steps = steps
    cfg.train.warmup_steps = max(1, min(cfg.train.warmup_steps, steps // 10))
    cfg.train.eval_every = steps
    cfg.train.ckpt_every = steps
    cfg.train.log_every = max(1, steps // 10)
    cfg.train.async_checkpoints = False
    cfg.data.packing = "document"  # the rule the recorded captures were trained with, whatever the default
    return configs.with_overrides(cfg, sets)


def ensure_checkpoint(workdir: str | Path, *, steps: int, sets: list[str] | None = None, progress: bool = True) -> dict:
    """Train the tiny dense model in ``workdir`` unless it already holds a checkpoint."""
    if has_checkpoint(workdir):
        return {"trained_now": False, "workdir": str(workdir)}
    from longctx.train.loop import train  # deferred: bench --help start-up: no orbax

    cfg = tiny_dense_config(steps, sets)
    summary = train(cfg, workdir, progress=progress)
    return {"trained_now": True, "workdir": str(workdir), "summary": summary}


class Capturer:
    def __init__(self, workdir: str | Path, *, layer: int = 0, split: str = "valid"):
        from longctx.runtime import Runner  # deferred: bench --help start-up: no orbax

        self.runner = Runner.from_workdir(workdir, overrides={"model.scan_layers": "off"})  # block by block
        self.model = self.runner.model()
        self.layer = layer
        blocks = self.model.blocks
        if not 0 <= layer < len(blocks):
            raise ValueError(f"--layer {layer}: the model has {len(blocks)} blocks")
        self.tokens = np.asarray(self.runner.load_split(split).tokens)
        self.step = self.runner.step
        self.cfg = self.runner.cfg

        @nnx.jit
        def _run(model, tokens):
            T = tokens.shape[1]
            positions = jnp.arange(T, dtype=jnp.int32)
            x = model.embed_tokens(tokens, positions)
            for b in list(model.blocks)[:layer]:
                x, _ = b(x, None, positions=positions)
            q, k, v = model.blocks[layer].project(x, positions)
            return q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)

        self._run = _run

    def qkv(self, T: int, offset: int = 0):
        """q, k, v [1, H, T, Dh] of ``T`` consecutive validation tokens from ``offset`` (wrapping around)."""
        n = len(self.tokens)
        idx = (offset + np.arange(T)) % n
        toks = jnp.asarray(self.tokens[idx].astype(np.int32))[None]
        return self._run(self.model, toks)
