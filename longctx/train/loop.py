"""The training loop: resume, steps, periodic eval, checkpoints, signals, logs.

The config is validated once, here, on the way in. What is trained (a language model, a masked LM,
a generated recall task) is a task of :mod:`longctx.train.tasks`, picked once from the config: it
makes the batches, the train step and the evaluation, so the loop here only restores, steps, logs,
evaluates, checkpoints and stops. The loop imports no entry point and no evaluation command:
periodic validation scores through :mod:`longctx.protocols`.

The steps overlap: a step is dispatched, the next batch is read and sent to the devices while it
runs, and only then are the previous step's metrics checked for non-finite values (one step late,
so the host never waits on the device just for that check). A log record, a validation, a
checkpoint and a stop check the newest step first, so no checkpoint is ever written past a step
whose values were not checked. The JAX persistent compilation cache (``train.compilation_cache_dir``)
is set up on the way in, so a restarted run loads its compiled steps instead of compiling again.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import signal
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from longctx import attention
from longctx import config as config_lib
from longctx.attention import dispatch
from longctx.data import sources
from longctx.data.prepare import default_cache_dir
from longctx.errors import CheckpointError, ConfigError, NonFiniteError, WorkdirError
from longctx.models import precision
from longctx.models.decoder import build_model
from longctx.protocols import EvaluationStopped
from longctx.train import checkpoint, distributed, sharding, tasks
from longctx.train.lock import WorkdirLock
from longctx.train.metrics import MetricsWriter, log_line, plot_losses, read_metrics
from longctx.train.optim import make_optimizer, schedule
from longctx.train.step import LossScaleState, loss_scale_setting, split_model, with_loss_scale

LN2 = math.log(2.0)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits at the next step boundary."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def agreed_signal(signum: int | None) -> int | None:
    """The stop signal as every process of the job sees it: this process's (single-process), else the largest any
    process has received (a signal reaches the processes at different steps; a process that stopped alone would
    wait in its checkpoint's collectives for the others, which go on training: the job hangs). A multi-process
    job pays one small all-gather per step for it."""
    if jax.process_count() == 1:
        return signum
    from jax.experimental import multihost_utils

    seen = int(np.max(multihost_utils.process_allgather(np.array([signum or 0], np.int32))))
    return seen or None


# train-step metrics the loop reports itself; every other key (the model's aux losses and metrics,
# e.g. a method's per-layer diagnostics) is logged as it comes, averaged over the step's windows
_CORE_METRICS = ("loss", "ce", "grad_norm", "loss_finite", "grad_finite", "loss_scale", "loss_scale_overflow")
_FINITE_KEYS = ("loss_finite", "grad_finite", "loss_scale_overflow")


def finite_updates(metrics: dict) -> np.ndarray:
    """Per window: whether the update was finite. A dynamic loss scale's overflow (``loss_scale_overflow``: the
    update skipped and the scale halved, :mod:`longctx.train.step`) is not a non-finite step."""
    ok = np.asarray(metrics["loss_finite"]).ravel() & np.asarray(metrics["grad_finite"]).ravel()
    if "loss_scale_overflow" in metrics:
        ok = ok | np.asarray(metrics["loss_scale_overflow"]).ravel()
    return ok


def crossed(prev_step: int, step: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (prev_step, step]: the step advances by the number of
    windows per row, so "every N steps" fires when a multiple is crossed, not only when hit."""
    return step // every > prev_step // every


def extra_metrics(metrics: dict) -> dict:
    return {k: float(np.mean(v)) for k, v in metrics.items() if k not in _CORE_METRICS}


def first_nonfinite_window(metrics: dict) -> int | None:
    ok = finite_updates(metrics)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else None


def kernels_note(cfg) -> str | None:
    """:func:`dispatch.kernels_line` of the implementations the last compile selected, with each method's other
    implementations on that platform (what ``impl`` can name instead of the kernel)."""
    choices = dispatch.chosen()
    others = {}
    for method, picked in choices.items():
        if method not in attention.names():
            continue
        plat = next(iter(picked.values()))[0]
        others[method] = tuple(i.name for i in attention.get_class(method).implementations(causal=cfg.model.causal)
                               if not i.kernel and i.name != "reference" and plat in i.platforms)
    return dispatch.kernels_line(choices, others)


def nonfinite_message(step: int, metrics: dict) -> str | None:
    bad = []
    if not bool(np.all(metrics["loss_finite"])):
        bad.append(f"loss={float(np.asarray(metrics['loss']).ravel()[-1])}")
    grads_ok = np.asarray(metrics["grad_finite"]).ravel()
    if "loss_scale_overflow" in metrics:
        grads_ok = grads_ok | np.asarray(metrics["loss_scale_overflow"]).ravel()
    if not bool(np.all(grads_ok)):
        bad.append("gradient global norm is non-finite")
    if not bad:
        return None
    return (
        f"non-finite values at step {step}: {', '.join(bad)}; lower train.lr, raise train.warmup_steps, "
        "or set train.on_nonfinite=skip to skip such updates"
    )


def _over(defaults: dict, saved: dict) -> dict:
    out = dict(defaults)
    for k, v in saved.items():
        out[k] = _over(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# model keys that choose a layout or a recomputation, not the function: a run may resume with them changed
# (a checkpoint of the other layer layout is converted on restore)
RESUMABLE_MODEL_KEYS = ("scan_layers", "remat", "remat_policy")


def check_resume_config(saved: dict, cfg: ml_collections.ConfigDict) -> None:
    """Refuse to resume a run whose model or data differ from ``cfg``'s (both validated, then compared key by key;
    the keys of :data:`RESUMABLE_MODEL_KEYS` and ``data.packing``, the rows' layout, may change)."""
    now = json.loads(cfg.to_json())
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            saved = json.loads(config_lib.validate(config_lib.merge_over_base(saved)).to_json())
    except ConfigError:  # no longer a valid config: compare what was saved, as saved
        saved = {**saved, "data": _over(json.loads(config_lib.base_config().data.to_json()), saved.get("data", {}))}
    for section in ("model", "data"):
        a, b = dict(saved.get(section, {})), dict(now.get(section, {}))
        if section == "data":  # how rows are laid out may change on resume (resume_changes names it)
            a.pop("packing", None), b.pop("packing", None)
        if section == "model":
            for k in RESUMABLE_MODEL_KEYS:
                a.pop(k, None), b.pop(k, None)
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ConfigError(
                f"the workdir holds a run with a different {section} config (differs in {', '.join(keys[:4])}); "
                "use a new --workdir or the same config"
            )


def check_resume_steps(saved: dict, cfg: ml_collections.ConfigDict, step: int, workdir) -> None:
    """Refuse, before anything is written, a config whose ``train.steps`` was lowered below the checkpoint's step:
    the run is past it, so nothing would train, and the saved config would record settings the run never trained
    with."""
    was = saved.get("train", {}).get("steps")
    if step > cfg.train.steps and was != cfg.train.steps:
        raise ConfigError(f"the run in {workdir} is at step {step:,}, past train.steps={cfg.train.steps:,} (it "
                          f"trained for {was}): raise train.steps to continue it, or use a new --workdir")


# train keys that change what the remaining updates compute (the schedule, the batches, the update itself)
TRAINING_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "grad_clip",
                 "seed", "batch_size", "seq_len", "window", "short_steps", "short_seq_len", "microbatches")


def resume_changes(saved: dict, cfg: ml_collections.ConfigDict, step: int) -> str | None:
    """One line naming the training settings that differ from the checkpoint's run, with the learning rate at
    ``step`` before and after when the schedule moved (the resumed run then differs from an uninterrupted one
    of either config); None when nothing differs."""
    was, now = saved.get("train", {}), cfg.train
    changed = [k for k in TRAINING_KEYS if k in was and was[k] != now[k]]
    # data.packing: an import's config holds 'auto' (written with no corpus read): the rule resolved now is no change
    packing = saved.get("data", {}).get("packing", "auto"), cfg.data.packing
    moved = [f"data.packing {packing[0]!r} -> {packing[1]!r}"] if packing[0] not in ("auto", packing[1]) else []
    if not changed and not moved:
        return None
    what = ", ".join([f"train.{k} {was[k]} -> {now[k]}" for k in changed] + moved)
    lr = ""
    keys = ("steps", "lr", "warmup_steps", "min_lr_ratio")
    if set(keys) & set(changed):
        old = schedule(types.SimpleNamespace(**{k: was.get(k, now[k]) for k in keys}))
        lr = f"; learning rate at step {step}: {float(old(step)):.3g} -> {float(schedule(now)(step)):.3g}"
    return (f"note: resuming with {what}{lr} (the schedule follows the new settings: the run differs from an "
            "uninterrupted run of either config)")


def check_resume_loss_scale(saved: dict, cfg: ml_collections.ConfigDict) -> None:
    """A loss-scaled run keeps its scale in the optimizer state: refuse to resume it with loss scaling turned off,
    or a run without it with loss scaling on (the checkpoint's optimizer state would not fit)."""
    was = loss_scale_setting(ml_collections.ConfigDict(saved))[0] != "none"
    now = loss_scale_setting(cfg)[0] != "none"
    if was != now:
        raise ConfigError(
            f"the workdir holds a run trained {'with' if was else 'without'} loss scaling (train.loss_scale); "
            f"resume it {'with' if was else 'without'} loss scaling (e.g. train.loss_scale="
            f"{'dynamic' if was else 'none'}), or use a new --workdir")


def setup_compilation_cache(tc, data_cfg) -> str | None:
    """Point JAX's persistent compilation cache at ``train.compilation_cache_dir`` ('' -> the
    ``JAX_COMPILATION_CACHE_DIR`` environment variable if set, else ``<data cache dir>/jax_compile``;
    'none' -> off). Returns the folder used, or None. Called before anything is compiled."""
    val = tc.compilation_cache_dir.strip()
    if val.lower() == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if not val and jax.config.jax_compilation_cache_dir:  # set by the environment
        return jax.config.jax_compilation_cache_dir
    path = Path(val).expanduser() if val else Path(data_cfg.cache_dir or default_cache_dir()) / "jax_compile"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"warning: no persistent compilation cache ({e.strerror or e}: {path}); set "
              "train.compilation_cache_dir to a writable folder, or 'none'", file=sys.stderr, flush=True)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def train(cfg: ml_collections.ConfigDict, workdir: str | Path, *, progress: bool = True, max_steps: int | None = None) -> dict:
    """Train per ``cfg`` in ``workdir`` (resuming from its newest valid checkpoint). Returns a summary.

    The primary host holds ``WORKDIR/train.lock`` (:mod:`longctx.train.lock`) while it trains."""
    held = []
    try:
        return _train(cfg, workdir, progress=progress, max_steps=max_steps, held=held)
    finally:
        for lock in held:
            lock.release()


def prepare_workdir(workdir: Path) -> None:
    """Make ``workdir`` (a writable folder) or say in one line why it cannot be used."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise WorkdirError(f"--workdir {workdir} exists and is not a folder; choose a folder") from None
    except OSError as e:
        raise WorkdirError(f"cannot create --workdir {workdir} ({e.strerror}); choose a writable folder") from None
    if not workdir.is_dir():
        raise WorkdirError(f"--workdir {workdir} exists and is not a folder; choose a folder")


def _train(cfg, workdir, *, progress: bool, max_steps: int | None, held: list) -> dict:
    cfg, workdir = open_run(cfg, workdir, max_steps=max_steps, held=held)
    progress = progress and distributed.is_primary()
    task = tasks.from_config(cfg, progress=progress)  # language model, masked LM or a generated recall task
    cfg = task.cfg  # the vocabulary resolved from the task's tokenizer
    tc = cfg.train
    mesh = sharding.make_mesh(cfg.mesh)
    model = build_model(cfg.model, seed=tc.seed, execution=cfg.execution)
    graphdef, params, nongrad, rest = split_model(model)
    tx = with_loss_scale(make_optimizer(tc), cfg)  # train.loss_scale: the scale lives in the optimizer state
    opt_state = tx.init(params)
    plan = sharding.Plan(mesh, params, nongrad, rest, tx, opt_state, sharding.parse_rules(cfg.mesh.rules))
    params, nongrad, rest, opt_state = plan.put(params, nongrad, rest, opt_state)

    mngr = checkpoint.manager(workdir, keep=tc.keep_checkpoints, async_save=tc.async_checkpoints)
    step, last_saved = 0, None
    if mngr.all_steps():
        def target(meta):
            check_resume_config(meta["config"], cfg)
            check_resume_loss_scale(meta["config"], cfg)
            return {"params": params, "nongrad": nongrad, "opt_state": opt_state}

        tree, meta = checkpoint.restore(mngr, target)
        params, nongrad, opt_state = tree["params"], tree["nongrad"], tree["opt_state"]
        step = last_saved = meta["step"]
        check_resume_steps(meta["config"], cfg, step, workdir)
        scale = f" (loss scale {float(opt_state.scale):g})" if isinstance(opt_state, LossScaleState) else ""
        print(f"resuming from the checkpoint at step {step} in {workdir}{scale}")
        note = resume_changes(meta["config"], cfg, step)
        if note:
            print(note)
    write_config(workdir, cfg)

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    task.setup(model, graphdef, tx, plan)
    task.check_evaluation((params, nongrad, rest))  # a validation the model's state cannot run: refused now
    writer = open_metrics(workdir, step)
    base_key = jax.random.key(tc.seed)
    def tokens_per_step(at_step):  # per update
        return tc.batch_size * config_lib.update_tokens(cfg, at_step)
    end = tc.steps if max_steps is None else min(tc.steps, step + max_steps)
    pol = precision.policy(cfg.model)
    print(f"model: {n_params:,} parameters, attention={config_lib.attention_label(cfg.model)}, block={cfg.model.block}, "
          f"{jnp.dtype(pol.compute).name} over {jnp.dtype(pol.param).name} weights, {cfg.model.num_layers} layers "
          f"{'scanned' if cfg.model.scan_layers == 'on' else 'unrolled'}; data: {task.summary()}")
    for note in config_lib.exact_attention_notes(cfg):
        print(note)
    bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)

    def save(at_step):
        nonlocal last_saved
        checkpoint.save(mngr, at_step, {"params": params, "nongrad": nongrad, "opt_state": opt_state}, config=cfg,
                        extra=task.checkpoint_extra())
        last_saved = at_step

    def save_now(at_step):
        save(at_step)
        checkpoint.wait(mngr)

    def close(failing: bool = False):
        bar.close()
        try:
            writer.close()
        except Exception:  # noqa: BLE001 -- a full disk fails the log flush too; the error being raised says so
            if not failing:
                raise
        try:
            mngr.close()
        except Exception:  # noqa: BLE001 -- a failed async write was already reported
            pass

    last_valid = None
    skips = SkipCounter(tc.max_skipped_in_row)
    lr_at = schedule(tc)
    # --noprogress (primary host): the log records are printed as lines instead of a bar's postfix
    print_lines = not progress and distributed.is_primary()
    # tokens/s and step time exclude compilation: each training shape (rows of seq_len, and of
    # short_seq_len in staged training) compiles on its first step, which is timed on its own
    compiled = set()
    t_last, tok_since, steps_since = time.time(), 0, 0

    # the newest dispatched step whose metrics were not checked yet: (step before it, its step, metrics on device)
    pending = None

    def check(entry, later=None):
        """Check a dispatched step's metrics for non-finite values (train.on_nonfinite) and return them on
        the host. ``later``: the metrics of the step already dispatched after it, if any (the stop
        then saves the last finite state only if that step skipped every update too)."""
        prev_step, at_step, metrics = entry
        metrics = jax.device_get(metrics)
        if tc.on_nonfinite == "stop":
            msg = nonfinite_message(at_step, metrics)
            if msg:
                seen = metrics
                if later is not None:
                    later = jax.device_get(later)
                    seen = {k: np.concatenate([np.asarray(metrics[k]).ravel(), np.asarray(later[k]).ravel()])
                            for k in _FINITE_KEYS if k in metrics}
                raise NonFiniteError(msg + stop_on_nonfinite(prev_step, seen, save_now, last_saved))
        else:
            skips.update(at_step, metrics, last_saved)
        return metrics

    def settle():
        """Check the newest step now (before a log record, a validation, a checkpoint or the end);
        its metrics on the host, or None when every step was checked already."""
        nonlocal pending
        entry, pending = pending, None
        return None if entry is None else check(entry)

    try:
        with StopFlag() as stop:
            batch = task.batch(step) if step < end else None
            while step < end:
                key = jax.random.fold_in(base_key, step)
                n_win = task.windows_at(step)
                shape = (tokens_per_step(step), n_win)  # a window's tokens, the row's windows
                compiling = shape not in compiled
                if compiling:
                    tqdm.write(f"compiling the train step (windows of {shape[0] // tc.batch_size} tokens)...")
                    t_compile = time.time()
                    dispatch.forget_chosen()  # the implementations this compile selects
                try:
                    params, nongrad, opt_state, metrics = task.train_step(params, nongrad, rest, opt_state, batch,
                                                                          key)
                except Exception:
                    line = kernels_note(cfg) if compiling else None
                    if line:  # a kernel that failed to compile on this device: the way around it
                        print(line, file=sys.stderr, flush=True)
                    raise
                prev, step = step, step + n_win
                # the next batch is read and transferred while this step runs
                batch = task.batch(step) if step < end else None
                if compiling:
                    jax.block_until_ready(metrics)
                    compiled.add(shape)
                    tqdm.write(f"compiled the train step and ran step {step} in {time.time() - t_compile:.1f} s")
                    if len(compiled) == 1 and (line := kernels_note(cfg)):
                        tqdm.write(line)
                    t_last, tok_since, steps_since = time.time(), 0, 0
                else:
                    tok_since += tokens_per_step(prev) * n_win
                    steps_since += n_win
                # the previous step's check, one step late: this step is already queued behind it
                if pending is not None:
                    check(pending, later=metrics)
                pending = (prev, step, metrics)
                if crossed(prev, step, tc.log_every) or step >= end:
                    rec = train_record(settle(), lr=lr_at(step - 1), seconds=time.time() - t_last,
                                       tokens=tok_since, steps=steps_since)
                    writer.write(step, "train", rec)
                    t_last, tok_since, steps_since = time.time(), 0, 0
                    if print_lines:
                        tqdm.write(printed_line(step, tc.steps, rec))
                    bar.set_postfix({"loss": f"{rec['loss']:.3f}",
                                     **({"bpt": f"{rec['bits_per_token']:.3f}"} if "bits_per_token" in rec else {}),
                                     "tok_s": f"{rec['tokens_per_sec']:.0f}" if "tokens_per_sec" in rec else "-",
                                     **({"valid bpt": f"{last_valid:.3f}"} if last_valid is not None else {})})
                bar.update(n_win)
                if crossed(prev, step, tc.ckpt_every) or step >= tc.steps:
                    settle()  # never a checkpoint of a step not checked
                    save(step)  # before the validation: a validation that fails or is stopped loses no step
                signum = agreed_signal(stop.signum)  # every process stops at the same step (and saves with the others)
                evaluated = (crossed(prev, step, tc.eval_every) or step >= tc.steps) and signum is None
                if evaluated:
                    settle()
                    t_eval = time.time()
                    try:  # a signal during a long validation stops it at the next forward call
                        res = task.evaluate((params, nongrad, rest),
                                            stop=lambda: agreed_signal(stop.signum) is not None)
                    except EvaluationStopped:
                        res = None
                    if res is not None:
                        writer.write(step, "valid", task.valid_record(res))
                        last_valid = res["bits_per_token"]
                        if print_lines:
                            tqdm.write(f"step {step}/{tc.steps}: valid {last_valid:.4f} bits/token")
                        # a disabled bar (--noprogress, non-primary hosts) has no postfix
                        shown = (getattr(bar, "postfix", None) or "").split(", valid bpt=")[0]
                        bar.set_postfix_str(", ".join(p for p in (shown, f"valid bpt={last_valid:.3f}") if p))
                        if distributed.is_primary():
                            plot_losses(workdir)
                    t_last += time.time() - t_eval  # tokens/s and step time count training only
                    bar.unpause()  # and so does the bar's own rate
                if evaluated:  # a signal that came during the validation
                    signum = agreed_signal(stop.signum)
                if signum is not None:
                    settle()
                    bar.close()
                    if last_saved != step:
                        save(step)
                    checkpoint.wait(mngr)
                    print(f"stopped by signal {signum} at step {step}; checkpoint saved in {workdir}. "
                          "Run the same command again to resume.")
                    close()
                    raise SystemExit(128 + signum)
        settle()
        if last_saved != step:
            save(step)
        checkpoint.wait(mngr)
    except (CheckpointError, NonFiniteError):
        close(failing=True)
        raise
    close()
    if distributed.is_primary():
        plot_losses(workdir)
    if skips.total:
        skips.warn(f"warning: {skips.total} non-finite update(s) were skipped in this run (train.on_nonfinite=skip)")
    if last_valid is None:  # nothing trained now (the run had reached train.steps): the run's last validation
        last_valid = next((r["bits_per_token"] for r in reversed(read_metrics(workdir))
                           if r.get("split") == "valid" and "bits_per_token" in r), None)
    return {"step": step, "params": n_params, "last_valid_bits_per_token": last_valid, "skipped_updates": skips.total}


def open_run(cfg, workdir, *, max_steps: int | None, held: list) -> tuple[ml_collections.ConfigDict, Path]:
    """(the validated config, the workdir): the config is checked once, before any data work; the
    persistent compilation cache is set up, the workdir made and, on the primary host, its lock taken
    (appended to ``held``)."""
    if "://" in str(workdir):  # Path() would fold gs://b/x into a local folder gs:/b/x
        raise WorkdirError(f"--workdir {workdir}: object-storage workdirs are not supported (the lock, metrics and "
                           "TensorBoard logs need a file system); use a local or mounted folder (e.g. a bucket "
                           "mounted with gcsfuse) visible to every host")
    workdir = Path(workdir)
    distributed.initialize_from_env()
    cfg = config_lib.validate(cfg)
    attention.check_execution(cfg, dispatch.current_platform())  # a named implementation that cannot run here
    sharding.check_layout(cfg, jax.device_count())  # a mesh or batch the devices cannot take
    if not sources.is_generated(cfg.data.source):
        sources.build(cfg.data)  # a corpus that is not where the config says: one line, before the workdir exists
    setup_compilation_cache(cfg.train, cfg.data)  # before the first compile
    if max_steps is not None and max_steps <= 0:
        raise ConfigError(f"--max_steps={max_steps} must be a positive integer")
    prepare_workdir(workdir)
    if distributed.is_primary():
        held.append(WorkdirLock(workdir).acquire())
    return cfg, workdir


def write_config(workdir: Path, cfg) -> None:
    """The resolved config as ``WORKDIR/config.json`` (primary host)."""
    try:
        if distributed.is_primary():
            (workdir / "config.json").write_text(cfg.to_json(indent=1))
    except OSError as e:
        raise WorkdirError(f"cannot write {workdir / 'config.json'} ({e.strerror or e}); the workdir must be a "
                           "writable folder whose config.json is a file") from None


def open_metrics(workdir: Path, step: int) -> MetricsWriter:
    """The metrics log, cut back to ``step`` (a resume), or one line saying why it cannot be written."""
    try:
        return MetricsWriter(workdir, resume_step=step, enabled=distributed.is_primary())
    except (OSError, UnicodeDecodeError) as e:  # a full disk, metrics.jsonl a folder or not text
        why = "the disk is full" if getattr(e, "errno", None) == errno.ENOSPC else (
            getattr(e, "strerror", None) or " ".join(str(e).split())[:120])
        raise WorkdirError(f"cannot rewrite {workdir / 'metrics.jsonl'} for the resume ({why}); free space, or move "
                           "the file aside if it is not this run's log, and run again") from None


def train_record(metrics: dict, *, lr, seconds: float, tokens: int, steps: int) -> dict:
    """The 'train' log record of a checked step's ``metrics`` (on the host); ``tokens`` and ``steps``
    trained in the ``seconds`` since the last record (no throughput when only a compiling step ran)."""
    ce = float(np.mean(metrics["ce"]))
    # attention transfer (its per-layer ``layer{i}/transfer_mse``): ``ce`` is the summed transfer MSE, not a
    # cross-entropy, so it is logged under its own name and has no bits per token
    named = {"transfer_mse": ce} if any(k.endswith("/transfer_mse") for k in metrics) else {"bits_per_token": ce / LN2}
    rec = {"loss": ce, **named, "grad_norm": float(np.mean(metrics["grad_norm"])), "lr": float(lr)}
    if steps:  # not measurable when only the compiling step ran since the last record
        rec.update(tokens_per_sec=tokens / max(seconds, 1e-9), step_time=seconds / steps)
    if "loss_scale" in metrics:  # loss scaling: the newest update's scale, and the overflows among the step's
        rec["loss_scale"] = float(np.asarray(metrics["loss_scale"]).ravel()[-1])
        rec["loss_scale_overflows"] = int(np.sum(metrics["loss_scale_overflow"]))
    rec.update(extra_metrics(metrics))
    return rec


def printed_line(step: int, total: int, rec: dict) -> str:
    """The printed line of a train record (``--noprogress``): :func:`longctx.train.metrics.log_line`, or during
    attention transfer the summed transfer MSE in place of the loss and its bits per token."""
    if "bits_per_token" in rec:
        return log_line(step, total, rec)
    speed = f"  {rec['tokens_per_sec']:,.0f} tokens/s  {rec['step_time']:.3f} s/step" if "tokens_per_sec" in rec else ""
    return f"step {step}/{total}  transfer MSE {rec['transfer_mse']:.4g}  lr {rec['lr']:.3g}{speed}"


class SkipCounter:
    """``train.on_nonfinite=skip``: counts the skipped (non-finite) updates, warns when a run of them
    starts, and stops the run once ``limit`` updates in a row were skipped."""

    def __init__(self, limit: int, warn=None):
        import sys

        self.limit, self.total, self.in_row = limit, 0, 0
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def update(self, step: int, metrics: dict, last_saved) -> None:
        ok = finite_updates(metrics)
        for good in ok:
            if good:
                self.in_row = 0
                continue
            if self.in_row == 0:
                self.warn(f"warning: skipped a non-finite update at step {step} (train.on_nonfinite=skip; "
                          f"{self.total + 1} skipped so far)")
            self.in_row += 1
            self.total += 1
            if self.in_row >= self.limit:
                kept = (f"; the checkpoint at step {last_saved} holds the last finite values"
                        if last_saved is not None else "")
                raise NonFiniteError(
                    f"{self.in_row} updates in a row were non-finite and skipped, up to step {step} "
                    f"(train.max_skipped_in_row={self.limit}): lower train.lr or raise train.warmup_steps{kept}")


def stop_on_nonfinite(prev_step: int, metrics: dict, save, last_saved) -> str:
    """Checkpoint the last finite state when the stop leaves it exact, and say where it is.

    The step skipped every non-finite update; if every window from the first non-finite one on was
    non-finite, the state is exactly that of step ``prev_step + first`` (else later windows moved it
    and the newest checkpoint stays the last finite one)."""
    first = first_nonfinite_window(metrics)
    ok = finite_updates(metrics)
    at = prev_step + first
    if first is not None and not ok[first:].any() and at > 0 and at != last_saved:
        try:
            save(at)
            return f". Saved the last finite state as the checkpoint at step {at}"
        except CheckpointError:
            pass
    if last_saved is not None:
        return f". The checkpoint at step {last_saved} holds the last finite values"
    return ""
