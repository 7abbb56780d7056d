"""The training loop: resume, steps, periodic eval, checkpoints, signals, logs."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from longctx import config as config_lib
from longctx.data.batching import Batcher
from longctx.data.prepare import prepare
from longctx.errors import ConfigError, NonFiniteError
from longctx.models.decoder import build_model
from longctx.train import checkpoint, sharding
from longctx.train.metrics import MetricsWriter, plot_losses
from longctx.train.optim import make_optimizer
from longctx.train.step import make_train_step, split_model

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


def nonfinite_message(step: int, metrics: dict) -> str | None:
    bad = []
    if not bool(np.all(metrics["loss_finite"])):
        bad.append(f"loss={float(np.asarray(metrics['loss']).ravel()[-1])}")
    if not bool(np.all(metrics["grad_finite"])):
        bad.append("gradient global norm is non-finite")
    if not bad:
        return None
    return (
        f"non-finite values at step {step}: {', '.join(bad)}; lower train.lr, raise train.warmup_steps, "
        "or set train.on_nonfinite=skip to skip such updates"
    )


def check_resume_config(saved: dict, cfg: ml_collections.ConfigDict) -> None:
    now = json.loads(cfg.to_json())
    for section in ("model", "data"):
        if saved.get(section) != now.get(section):
            raise ConfigError(
                f"the workdir holds a run with a different {section} config; use a new --workdir or the same config"
            )


def train(cfg: ml_collections.ConfigDict, workdir: str | Path, *, progress: bool = True, max_steps: int | None = None) -> dict:
    """Train per ``cfg`` in ``workdir`` (resuming if it holds checkpoints). Returns a summary."""
    workdir = Path(workdir)
    config_lib.validate(cfg)  # fail fast, before any data work
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer, data, data_dir = prepare(cfg.data, ["train", cfg.eval.split], progress=progress)
    from longctx.runtime import Runner, resolve_vocab

    cfg = config_lib.validate(resolve_vocab(cfg, tokenizer.vocab_size))
    (workdir / "config.json").write_text(cfg.to_json(indent=1))
    tc = cfg.train
    n_win = config_lib.n_windows(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    model = build_model(cfg.model, seed=tc.seed)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    params, nongrad, rest, opt_state = sharding.replicate(mesh, (params, nongrad, rest, opt_state))

    mngr = checkpoint.manager(workdir, keep=tc.keep_checkpoints, async_save=tc.async_checkpoints)
    step = 0
    if mngr.latest_step() is not None:
        meta = checkpoint.read_meta(mngr)
        check_resume_config(meta["config"], cfg)
        tree, meta = checkpoint.restore(mngr, {"params": params, "nongrad": nongrad, "opt_state": opt_state})
        params, nongrad, opt_state = tree["params"], tree["nongrad"], tree["opt_state"]
        step = meta["step"]
        print(f"resuming from the checkpoint at step {step} in {workdir}")

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    batcher = Batcher(data["train"], row_len=tc.seq_len + 1, batch_size=tc.batch_size, seed=tc.seed,
                      shard=(jax.process_index(), jax.process_count()))
    train_step = jax.jit(
        make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=tc.on_nonfinite == "skip"),
        donate_argnums=(0, 1, 3),
    )
    writer = MetricsWriter(workdir, resume_step=step)
    base_key = jax.random.key(tc.seed)
    tokens_per_step = tc.batch_size * tc.window
    end = tc.steps if max_steps is None else min(tc.steps, max_steps)
    bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    print(f"model: {n_params:,} parameters, attention={cfg.model.attention.name}, block={cfg.model.block}; "
          f"data: {data['train'].num_tokens:,} train tokens ({batcher.tokens_usable:,} in documents >= {tc.seq_len + 1} tokens)")

    def evaluate_now(at_step):
        from longctx.evaluate import evaluate_split

        runner = Runner(cfg, graphdef, params, nongrad, rest, tokenizer=tokenizer, step=at_step)
        ecfg = ml_collections.ConfigDict(cfg.eval.to_dict())
        ecfg.max_tokens = tc.eval_tokens if cfg.eval.max_tokens == 0 else min(cfg.eval.max_tokens, tc.eval_tokens)
        res, _ = evaluate_split(runner, data[cfg.eval.split], ecfg, progress=False)
        writer.write(at_step, "valid", {"loss": res["loss_nats_per_token"], "bits_per_token": res["bits_per_token"]})
        return res

    def save(at_step):
        checkpoint.save(mngr, at_step, {"params": params, "nongrad": nongrad, "opt_state": opt_state}, config=cfg,
                        extra={"data_dir": str(data_dir)})

    last_valid = None
    t_last, tok_since = time.time(), 0
    with StopFlag() as stop:
        while step < end:
            batch = batcher.batch(step // n_win)
            tokens = sharding.shard_batch(mesh, batch["tokens"])
            key = jax.random.fold_in(base_key, step)
            params, nongrad, opt_state, metrics = train_step(params, nongrad, rest, opt_state, tokens, key)
            step += n_win
            tok_since += tokens_per_step * n_win
            if tc.on_nonfinite == "stop" or step % tc.log_every == 0 or step >= end:
                metrics = jax.device_get(metrics)
                msg = nonfinite_message(step, metrics) if tc.on_nonfinite == "stop" else None
                if msg:
                    bar.close()
                    writer.close()
                    mngr.close()
                    raise NonFiniteError(msg)
            if step % tc.log_every == 0 or step >= end:
                ce = float(np.mean(metrics["ce"]))
                dt = time.time() - t_last
                rec = {"loss": ce, "bits_per_token": ce / LN2, "grad_norm": float(np.mean(metrics["grad_norm"])),
                       "tokens_per_sec": tok_since / max(dt, 1e-9)}
                rec.update({k: float(np.mean(v)) for k, v in metrics.items() if k.startswith("aux/")})
                writer.write(step, "train", rec)
                t_last, tok_since = time.time(), 0
                bar.set_postfix(loss=f"{ce:.3f}", bpt=f"{ce / LN2:.3f}", tok_s=f"{rec['tokens_per_sec']:.0f}",
                                valid=f"{last_valid:.3f}" if last_valid else "-")
            bar.update(n_win)
            if step % tc.eval_every == 0 or step >= tc.steps:
                last_valid = evaluate_now(step)["bits_per_token"]
                bar.set_postfix_str(f"{bar.postfix}, valid bpt={last_valid:.3f}")
                plot_losses(workdir)
            if step % tc.ckpt_every == 0 or step >= tc.steps:
                save(step)
            if stop.signum is not None:
                bar.close()
                if mngr.latest_step() != step:
                    save(step)
                mngr.wait_until_finished()
                print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved in {workdir}. "
                      "Run the same command again to resume.")
                writer.close()
                mngr.close()
                raise SystemExit(128 + stop.signum)
    bar.close()
    if mngr.latest_step() != step:
        save(step)
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
    plot_losses(workdir)
    return {"step": step, "params": n_params, "last_valid_bits_per_token": last_valid}


