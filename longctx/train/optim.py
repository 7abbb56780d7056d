"""Optimizer: AdamW with linear warm-up + cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax


def schedule(tc):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.lr,
        warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps,
        end_value=tc.lr * tc.min_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on matrices only (not on norms, biases or vectors)."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(tc) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip) if tc.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay, mask=decay_mask),
    )


def _key(entry):
    """A tree path entry's key (a dict key, an attribute name or a sequence index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def core_mask(params, layers):
    """A tree of bools over ``params`` (an unrolled model's, ``blocks/<i>/...``): True for the parameters of the
    attention cores of ``layers`` (what attention transfer trains), False for everything else."""
    layers = set(layers)

    def own(path, _):
        keys = tuple(_key(e) for e in path)
        return len(keys) > 2 and keys[0] == "blocks" and keys[1] in layers and keys[2] == "core"

    return jax.tree_util.tree_map_with_path(own, params)
