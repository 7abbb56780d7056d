"""`longctx-bench step`: the whole-model training step of any config, timed at given lengths.

    longctx-bench step --config configs/builtin/transformer_vq.py --lengths 1k,4k,16k --batch_size 1

For each length T the config gets ``train.seq_len = T`` (``--window``: ``train.window``; default the
whole row), is validated, and one jitted training step (loss, gradient and optimizer update, as
``longctx-train`` runs it) is compiled on random tokens. The timed calls are interleaved across the
lengths (round r times every length once), so a slow spell of the machine touches every length
alike; the result per length is the median, with tokens/s, the CPU time per wall second, minor page
faults per step (memory churn) and XLA's compiled memory analysis. No data is read: the step's cost
does not depend on the token values.
"""

from __future__ import annotations

import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from longctx import config as config_lib
from longctx.bench import common as C
from longctx.bench import configs
from longctx.errors import ConfigError


def add_args(p):
    p.add_argument("--config", default=configs.DEFAULT,
                   help="config file with get_config() (FILE or FILE.py:variant; default: configs/default.py, "
                        "found in the working directory or the project)")
    p.add_argument("--lengths", default="1k,4k,16k", help="comma list of row lengths train.seq_len (k = 1024)")
    p.add_argument("--batch_size", type=int, default=1, help="rows per step (train.batch_size)")
    p.add_argument("--window", type=int, default=0,
                   help="train.window: tokens per update, state carried (0: the whole row, one update)")
    p.add_argument("--vocab_size", type=int, default=256, help="the tokenizer's vocabulary (256: bytes)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per length (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per length after compiling")


def length_config(base, T: int, args):
    cfg = config_lib.merge_over_base(base)
    with cfg.unlocked():
        cfg.train.seq_len = T
        cfg.train.batch_size = args.batch_size
        cfg.train.window = args.window if args.window else 0
        if args.window and T % args.window:
            raise ConfigError(f"--window={args.window} must divide every length; {T} is not a multiple")
        # steps only shapes the learning-rate schedule here; it must count whole rows of windows
        cfg.train.steps = max(cfg.train.steps, cfg.train.warmup_steps + 1) * (T // (args.window or T))
        cfg.train.short_steps = 0
        cfg.train.short_seq_len = 0
    cfg = config_lib.validate(cfg)
    return config_lib.resolve_vocab(cfg, args.vocab_size)


def build_step(cfg, seed: int = 0):
    """(compiled step, its arguments, XLA memory stats, parameter count) for a validated config."""
    from longctx.models.decoder import build_model
    from longctx.train.optim import make_optimizer
    from longctx.train.step import make_train_step, split_model

    if cfg.model.kind != "decoder":
        raise ConfigError(f"longctx-bench step times decoder training steps; model.kind={cfg.model.kind!r}")
    tc = cfg.train
    model = build_model(cfg.model, seed=tc.seed, execution=cfg.execution)
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    step = make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=True)
    tokens = jax.random.randint(jax.random.key(seed), (tc.batch_size, tc.seq_len + 1), 0, cfg.model.vocab_size,
                                dtype=jnp.int32)
    args = (params, nongrad, rest, opt_state, tokens, jax.random.key(seed + 1))
    compiled = jax.jit(step).lower(*args).compile()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return compiled, args, C.memory_stats(compiled), n_params


def _timed(compiled, args) -> dict:
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    C.block(compiled(*args))
    t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    return {"s": t1 - t0, "cpu_s": c1 - c0, "minflt": r1.ru_minflt - r0.ru_minflt,
            "sys_s": r1.ru_stime - r0.ru_stime}


def _shown(path) -> str:
    """The config path relative to the root it was found under."""
    return configs.shown(path)


def base_config(args):
    """``--config`` (configs/default.py, or the base config where no configs folder is found) with the
    ``--config.KEY=VALUE`` overrides."""
    cfg = configs.load_config_file(args.config) if (args.config != configs.DEFAULT
                                                    or configs.find_config(args.config)) else configs.default_config()
    return configs.with_overrides(cfg, args.overrides)


def run(args) -> dict:
    out = C.out_dir(args.out)
    lengths = C.parse_ints(args.lengths)
    if not lengths:
        raise ConfigError("--lengths: give at least one length, e.g. --lengths 1k,4k")
    if args.batch_size <= 0 or args.repeats <= 0 or args.warmup < 0:
        raise ConfigError("--batch_size and --repeats must be positive, --warmup >= 0")
    base = base_config(args)
    res = {"header": C.header(args, "step"), "config": _shown(args.config), "sets": list(args.overrides), "rows": []}
    bar = C.progress_bar(len(lengths) * (1 + args.repeats), "step", args.progress)
    built = {}
    for T in lengths:
        cfg = length_config(base, T, args)
        t0 = time.perf_counter()
        compiled, call_args, mem, n_params = build_step(cfg)
        compile_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            C.block(compiled(*call_args))
        built[T] = (compiled, call_args, mem, n_params, compile_s, cfg)
        bar.update(1)
    samples = {T: [] for T in lengths}
    for _ in range(args.repeats):  # interleaved: each round times every length once
        for T in lengths:
            samples[T].append(_timed(built[T][0], built[T][1]))
            bar.update(1)
    bar.close()
    for T in lengths:
        _, _, mem, n_params, compile_s, cfg = built[T]
        med = statistics.median(s["s"] for s in samples[T])
        tokens = cfg.train.batch_size * T
        res["rows"].append({
            "status": "ok", "T": T, "batch_size": cfg.train.batch_size, "window": cfg.train.window or T, "params": n_params,
            "step_s": med, "step_s_all": [s["s"] for s in samples[T]], "tokens_per_s": tokens / med,
            "cpu_per_wall": statistics.median(s["cpu_s"] / s["s"] for s in samples[T]),
            "sys_fraction": statistics.median(s["sys_s"] / max(s["cpu_s"], 1e-9) for s in samples[T]),
            "minor_faults": int(statistics.median(s["minflt"] for s in samples[T])),
            "xla_mem": mem, "compile_s": compile_s, "attention": cfg.model.attention.name, "block": cfg.model.block,
        })
    C.write_json(out / "step.json", res)
    (out / "step.md").write_text(markdown(res))
    plots(res, out)
    print(markdown(res))
    return res


def markdown(res: dict) -> str:
    rows = res["rows"]
    head = (f"Training step (loss + gradient + update) of `{res['config']}`"
            + (f" with {', '.join('`--config.' + s + '`' for s in res['sets'])}" if res["sets"] else "")
            + f"; {rows[0]['params']:,} parameters, attention `{rows[0]['attention']}`, block `{rows[0]['block']}`; "
            f"median of {len(rows[0]['step_s_all'])} interleaved steps.\n\n")
    table = C.md_table(
        ["T", "batch", "window", "step s", "tokens/s", "CPU s / wall s", "sys share", "minor faults / step",
         "XLA mem MB", "compile s"],
        [[C.fmt_len(r["T"]), r["batch_size"], r["window"], r["step_s"], r["tokens_per_s"], r["cpu_per_wall"],
          r["sys_fraction"], r["minor_faults"], r["xla_mem"].get("total", 0) / C.MB if "total" in r["xla_mem"] else None,
          r["compile_s"]] for r in rows])
    return head + table


def plots(res: dict, out) -> None:
    fig, (ax,) = C.new_figure(1)
    rows = res["rows"]
    ax.plot([r["T"] for r in rows], [r["tokens_per_s"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row length T (tokens)")
    ax.set_ylabel("training tokens / s")
    ax.set_title(f"{res['config']}: whole-model training step")
    ax.grid(alpha=0.3)
    C.save_figure(fig, out / "step_tokens_per_s.png")
