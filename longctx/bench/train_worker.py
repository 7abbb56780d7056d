"""Child process of `longctx-bench train`: one training run (own process, so its peak RSS is its own).

    python -m longctx.bench.train_worker CONFIG_JSON WORKDIR RESULT_JSON [--progress] [--xla_mem]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ml_collections

from longctx import config as config_lib
from longctx.bench.common import memory_stats
from longctx.host_memory import keep_freed_memory
from longctx.models.decoder import build_model
from longctx.train.optim import make_optimizer
from longctx.train.step import make_train_step, split_model


def xla_train_step_memory(workdir: Path) -> dict:
    """XLA compiled memory analysis of the run's jitted train step (resolved config from WORKDIR/config.json)."""
    import jax
    import jax.numpy as jnp

    cfg = config_lib.validate(ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text())))
    tc = cfg.train
    model = build_model(cfg.model, seed=tc.seed, execution=cfg.execution)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    step = jax.jit(make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window,
                                   skip_nonfinite=tc.on_nonfinite == "skip"), donate_argnums=(0, 1, 3))
    tokens = jax.ShapeDtypeStruct((tc.batch_size, tc.seq_len + 1), jnp.int32)
    compiled = step.lower(params, nongrad, rest, opt_state, tokens, jax.random.key(0)).compile()
    return memory_stats(compiled)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg_path, workdir, result = Path(argv[0]), Path(argv[1]), Path(argv[2])
    progress = "--progress" in argv

    keep_freed_memory()  # as longctx-train does
    from longctx.train.loop import train  # deferred: bench --help start-up: no orbax

    cfg = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
    t0 = time.time()
    summary = train(cfg, workdir, progress=progress)
    out = {"summary": summary, "train_wall_s": time.time() - t0}
    if "--xla_mem" in argv:
        try:
            out["xla_train_step_mem"] = xla_train_step_memory(workdir)
        except Exception as e:  # noqa: BLE001 -- optional number
            out["xla_train_step_mem"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    result.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
