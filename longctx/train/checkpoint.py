"""Orbax checkpoints: params, optimizer state, non-gradient model state, step,
resolved config, git SHA and a format version; async saves, keep-last-N."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from longctx.config import FORMAT_VERSION
from longctx.errors import CheckpointError

logging.getLogger("absl").setLevel(logging.ERROR)


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def manager(workdir: str | Path, *, keep: int = 3, async_save: bool = True, create: bool = True) -> ocp.CheckpointManager:
    directory = Path(workdir).resolve() / "checkpoints"
    if not create and not directory.exists():
        raise CheckpointError(f"no checkpoints in {Path(workdir)}: train first (longctx-train --workdir {workdir})")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=create)
    return ocp.CheckpointManager(directory, options=options)


def save(mngr: ocp.CheckpointManager, step: int, tree: dict, *, config, extra: dict | None = None) -> None:
    meta = {
        "step": int(step),
        "format_version": FORMAT_VERSION,
        "git_sha": git_sha(),
        "config": json.loads(config.to_json()),
        **(extra or {}),
    }
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)), force=True)


def read_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> dict:
    step = latest(mngr) if step is None else step
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def latest(mngr: ocp.CheckpointManager) -> int:
    step = mngr.latest_step()
    if step is None:
        raise CheckpointError(f"no checkpoint found in {mngr.directory}: train first, or point --workdir at a run")
    return step


def restore(mngr: ocp.CheckpointManager, target: dict, step: int | None = None, *, partial: bool = False) -> tuple[dict, dict]:
    """Restore into the structure (and shardings) of ``target``; returns (tree, meta).
    ``partial``: ``target`` names a subset of the saved items (e.g. params only)."""
    step = latest(mngr) if step is None else step
    if step not in mngr.all_steps():
        raise CheckpointError(f"checkpoint step {step} not found in {mngr.directory}; available: {sorted(mngr.all_steps())}")

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    item = jax.tree.map(abstract, target)
    if partial:
        state_args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
    else:
        state_args = ocp.args.StandardRestore(item)
    try:
        out = mngr.restore(step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()))
    except ValueError as e:
        first = str(e).splitlines()[0][:200]
        raise CheckpointError(f"checkpoint {step} in {mngr.directory} does not match this model ({first})") from None
    meta = out["meta"]
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format {meta.get('format_version')} in {mngr.directory}, this code reads {FORMAT_VERSION}"
        )
    return out["state"], meta
