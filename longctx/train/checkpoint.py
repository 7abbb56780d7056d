"""Orbax checkpoints: params, optimizer state, non-gradient model state, step,
resolved config, git SHA and a format version; async saves, keep-last-N.

What is read is checked, and what is written is whole:

* Orbax writes each checkpoint into ``<step>.orbax-checkpoint-tmp`` and renames it to
  ``<step>`` only when every file is written, so a kill at any moment (SIGKILL during an
  async save included) leaves at most a temporary directory, which is never listed as a
  step and is removed when training opens the directory again.
* Every checkpoint's metadata holds a CRC32 of each saved item (params, nongrad, opt_state),
  computed from the values on the host before writing; only finite values are written.
* :func:`restore` tries the newest checkpoint first and falls back to the newest one that
  reads, matches its CRCs and is finite, printing one warning that names each skipped step
  and why; if none is valid it raises one :class:`CheckpointError` listing them.
* A failed write (disk full, ...) raises :class:`CheckpointError` saying which step could
  not be written; the previous checkpoints are untouched.
* The metadata is verified like the arrays: a CRC32 of its own canonical JSON, the type of each
  field, ``step`` equal to the checkpoint's directory, the saved config valid, and every restored
  array of the shape and dtype of the model that config builds. A checkpoint failing any check is
  skipped like a corrupt one. No path is ever built from metadata content: the step a caller
  gets is the directory's integer.

Nothing in a checkpoint is executed: the state is Orbax/TensorStore arrays, the metadata JSON.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from longctx import config as config_lib
from longctx.config import FORMAT_VERSION
from longctx.errors import CheckpointError
from longctx.models.backbone import layer_layout, relayout, scans_layers

# orbax logs a full traceback for a failed async write before re-raising it; we report it in one line
logging.getLogger("absl").setLevel(logging.CRITICAL)
logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # and asyncio logs each failed write future again


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def manager(workdir: str | Path, *, keep: int = 3, async_save: bool = True, create: bool = True) -> ocp.CheckpointManager:
    """``create=True`` (training): make the directory and remove temporary directories left by a
    killed save. ``create=False`` (eval, sample): read only; a missing directory is an error."""
    directory = Path(workdir).resolve() / "checkpoints"
    if not create and Path(workdir).exists() and not Path(workdir).is_dir():
        raise CheckpointError(f"--workdir {workdir} is a file, not a run folder; point --workdir at a trained run")
    if not create and not directory.exists():
        raise CheckpointError(f"no checkpoints in {Path(workdir)}: train first (longctx-train --workdir {workdir})")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=create,
                                           cleanup_tmp_directories=create)
    return ocp.CheckpointManager(directory, options=options)


def _on_host(leaf) -> np.ndarray:
    """The whole value of ``leaf`` on this host; an array spread over several processes is gathered
    (a collective: every process of a multi-process job calls this for the same leaves, in order)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def _host_leaves(tree) -> list[tuple[str, np.ndarray]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), _on_host(leaf)) for path, leaf in flat]


def fingerprint(tree) -> int:
    """CRC32 over every leaf's path, dtype, shape and bytes, in tree order."""
    crc = 0
    for name, x in _host_leaves(tree):
        crc = zlib.crc32(f"{name}:{x.dtype}:{x.shape};".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(x).view(np.uint8).reshape(-1), crc)
    return crc


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves that hold a NaN or an infinity."""
    return [name for name, x in _host_leaves(tree)
            if np.issubdtype(x.dtype, np.floating) and not bool(np.all(np.isfinite(x)))]


def save(mngr: ocp.CheckpointManager, step: int, tree: dict, *, config, extra: dict | None = None) -> None:
    """Start writing ``tree`` (a dict of items) as checkpoint ``step``. Refuses non-finite values.
    Errors of an earlier async write surface here or in :func:`wait` as :class:`CheckpointError`."""
    bad = [f"{item}{name}" for item, sub in tree.items() for name in nonfinite_leaves(sub)]
    if bad:
        raise CheckpointError(f"refusing to write checkpoint {step}: non-finite values in {', '.join(bad[:3])}")
    meta = {
        "step": int(step),
        "format_version": FORMAT_VERSION,
        "git_sha": git_sha(),
        "config": json.loads(config.to_json()),
        "crc32": {item: fingerprint(sub) for item, sub in tree.items()},
        **(extra or {}),
    }
    meta[META_CRC] = meta_checksum(meta)
    if step in mngr.all_steps():  # a step found invalid earlier and now trained again
        mngr.delete(step)
    try:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
                  force=True)
    except Exception as e:  # noqa: BLE001 -- any write failure becomes one line
        raise write_error(mngr, step, e) from None


def wait(mngr: ocp.CheckpointManager) -> None:
    """Block until pending async writes are committed; a failed one raises :class:`CheckpointError`."""
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
        raise write_error(mngr, None, e) from None


def write_error(mngr, step, err: Exception) -> CheckpointError:
    text = " ".join(str(err).split())
    if "No space left" in text or "RESOURCE_EXHAUSTED" in text:
        why = "the disk is full"
    else:
        why = f"{type(err).__name__}: {text[:160]}"
    try:
        done = sorted(mngr.all_steps(read=True))
    except Exception:  # noqa: BLE001
        done = []
    which = f"checkpoint {step}" if step is not None else "a checkpoint"
    kept = f"the checkpoint at step {done[-1]} is intact" if done else "no earlier checkpoint exists"
    return CheckpointError(f"could not write {which} in {mngr.directory} ({why}); {kept}. "
                           "Free space or fix the directory, then run the same command to resume")


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


META_CRC = "meta_crc32"


def meta_checksum(meta: dict) -> int:
    """CRC32 of the metadata's canonical JSON (sorted keys), without its own checksum field."""
    body = {k: v for k, v in meta.items() if k != META_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def verify_meta(meta, step: int) -> None:
    """Types, checksum and step of one checkpoint's metadata, and its config valid; raises
    ``_Invalid`` with the reason."""
    if not isinstance(meta, dict):
        raise _Invalid(f"metadata is a JSON {type(meta).__name__}, not an object")
    if not _is_int(meta.get(META_CRC)) or meta_checksum(meta) != meta[META_CRC]:
        raise _Invalid("metadata do not match the checksum written with them")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _Invalid(f"format {str(meta.get('format_version'))[:20]!r}, this code reads {FORMAT_VERSION}")
    if not _is_int(meta.get("step")) or meta["step"] != step:
        raise _Invalid(f"metadata step {str(meta.get('step'))[:40]!r} is not the checkpoint's step {step}")
    crcs = meta.get("crc32")
    if not isinstance(crcs, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in crcs.items()):
        raise _Invalid("metadata crc32 is not a table of item checksums")
    for key in ("git_sha", "data_dir"):
        if key in meta and not isinstance(meta[key], str):
            raise _Invalid(f"metadata {key} is not a string")
    if not isinstance(meta.get("config"), dict):
        raise _Invalid("metadata config is not an object")

    try:
        config_lib.validate(config_lib.merge_over_base(meta["config"]))
    except Exception as e:  # noqa: BLE001 -- any failure of the saved config invalidates the checkpoint
        raise _Invalid(f"saved config is not valid ({' '.join(str(e).split())[:160]})") from None


def _check_shapes(name: str, got, want) -> None:
    """Every restored leaf has the shape and dtype the target (the model of the saved config) asks for."""
    got_flat, _ = jax.tree_util.tree_flatten_with_path(got)
    want_leaves = jax.tree.leaves(want)
    if len(got_flat) != len(want_leaves):
        raise _Invalid(f"{name} hold {len(got_flat)} arrays, the saved config's model {len(want_leaves)}")
    for (path, g), w in zip(got_flat, want_leaves):
        if not isinstance(g, (jax.Array, np.ndarray)):  # a partial restore leaves what it did not find
            raise _Invalid(f"{name}{jax.tree_util.keystr(path)} of the saved config's model is not in the checkpoint")
        if tuple(g.shape) != tuple(w.shape) or np.dtype(g.dtype) != np.dtype(w.dtype):
            raise _Invalid(f"{name}{jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)}, the saved config's "
                           f"model has {np.dtype(w.dtype)}{list(w.shape)}")


def latest(mngr: ocp.CheckpointManager) -> int:
    step = mngr.latest_step()
    if step is None:
        raise CheckpointError(f"no checkpoint found in {mngr.directory}: train first, or point --workdir at a run")
    return step


def _short(err: Exception) -> str:
    import re

    text = re.sub(r'Error opening "\w+" driver: ', "", " ".join(str(err).split()))
    return f"{type(err).__name__}: {text[:140]}"


def _restore_one(mngr, step: int, make_target, partial: bool) -> tuple[dict, dict]:
    """Read, check format, CRCs and finiteness of one checkpoint. Raises ``_Invalid`` with the reason."""
    try:
        meta = read_meta(mngr, step)
    except Exception as e:  # noqa: BLE001
        raise _Invalid(f"metadata unreadable ({_short(e)})") from None
    verify_meta(meta, step)
    target = make_target(meta) if callable(make_target) else make_target

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    asked = target
    target, to_scanned = _saved_layout(jax.tree.map(abstract, target), meta)
    item = target
    if partial:
        state_args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
    else:
        state_args = ocp.args.StandardRestore(item)
    try:
        tree = mngr.restore(step, args=ocp.args.Composite(state=state_args))["state"]
    except Exception as e:  # noqa: BLE001 -- truncated or corrupt files, or a different model
        raise _Invalid(f"unreadable or not this model ({_short(e)})") from None
    crcs = meta.get("crc32", {})
    for name in target:
        _check_shapes(name, tree[name], target[name])
        if name in crcs and fingerprint(tree[name]) != crcs[name]:
            raise _Invalid(f"{name} do not match the checksum written with them")
        bad = nonfinite_leaves(tree[name])
        if bad:
            raise _Invalid(f"non-finite values in {name}{bad[0]}")
    if to_scanned is not None:  # verified in the saved layout; now in the layout the caller asked for

        def place(x, like):
            sharding = getattr(like, "sharding", None)
            return x if sharding is None else jax.device_put(x, sharding)

        tree = {name: jax.tree.map(place, relayout(tree[name], scanned=to_scanned), asked[name]) for name in tree}
    return tree, meta


def _saved_layout(target, meta):
    """(``target`` in the layer layout of the checkpoint, the layout to convert the restored tree back to:
    True scanned, False unrolled, None no conversion). A checkpoint saved with ``model.scan_layers='on'`` (stacked
    blocks) restores into an unrolled model and vice versa (:func:`longctx.models.backbone.relayout`); ``meta``'s
    config (checked by :func:`verify_meta`) is read merged over the base config, as it is validated."""

    asked = layer_layout(target)
    saved = "scanned" if scans_layers(config_lib.merge_over_base(meta["config"]).model) else "unrolled"
    if asked is None or asked == saved:
        return target, None
    return relayout(target, scanned=saved == "scanned"), asked == "scanned"


class _Invalid(Exception):
    pass


def restore(mngr: ocp.CheckpointManager, target: dict | Callable[[dict], dict], step: int | None = None, *,
            partial: bool = False, warn=None) -> tuple[dict, dict]:
    """Restore into the structure (and shardings) of ``target``; returns (tree, meta).

    ``target`` is a dict of items, or a function of the checkpoint's metadata that returns one
    (e.g. a model built from the saved config). ``partial``: ``target`` names a subset of the saved
    items. With ``step=None`` the newest valid checkpoint is used and each newer invalid one is
    reported by one warning line (``warn``, default: stderr); an explicit ``step`` must be valid."""
    steps = sorted(mngr.all_steps(read=True), reverse=True)
    if not steps:
        latest(mngr)  # raises the "train first" error
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"checkpoint step {step} not found in {mngr.directory}; available: {sorted(steps)}")
        steps = [step]
    skipped = []
    for s in steps:
        try:
            tree, meta = _restore_one(mngr, s, target, partial)
        except _Invalid as e:
            skipped.append((s, str(e)))
            continue
        if skipped:
            why = "; ".join(f"step {k}: {r}" for k, r in skipped)
            (warn or _stderr)(f"warning: skipped invalid checkpoint(s) in {mngr.directory} ({why}); "
                              f"using step {s}")
        return tree, meta
    why = "; ".join(f"step {k}: {r}" for k, r in skipped)
    raise CheckpointError(f"no valid checkpoint in {mngr.directory} ({why}); train again in a new --workdir")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
