"""`longctx-bench step`: the whole-model training step of any config, timed at given lengths.

    longctx-bench step --config configs/builtin/transformer_vq.py --lengths 1k,4k,16k --batch_size 1

For each length T the config gets ``train.seq_len = T`` (``--window``: ``train.window``; default the
whole row), is validated, and one jitted training step (loss, gradient and optimizer update, as
``longctx-train`` runs it) is compiled on random tokens. The timed calls are interleaved across the
lengths (round r times every length once), so a slow spell of the machine touches every length
alike; the result per length is the median, with tokens/s, the CPU time per wall second, minor page
faults per step (memory churn) and XLA's compiled memory analysis. No data is read: the step's cost
does not depend on the token values. The rows are unpacked (one sequence each) whatever ``data.packing``: a config
that trains packed rows (``'auto'`` on a corpus of documents) pays its methods' packed layouts on top
(``longctx-train --dry_run`` counts that step's FLOPs).

Model FLOPs and MFU (the output states both definitions):

* model FLOPs per token = 3 x the matrix-multiply FLOPs of the model's forward pass (the loss of a training
  row, or of each window with its carried state) / tokens; backward = 2 x forward, recomputation (remat) not
  counted. The forward's matmuls are counted in its jaxpr (``common.jaxpr_matmul_flops``: 2·M·N·K per
  dot_general, a scan body times its length), so the count covers the config's own attention method as it
  computes it (a masked causal dense counts its whole T x T) and the parameter matmuls (the 6·N of the usual
  6·N + attention formula; an embedding lookup is no matmul). XLA's ``cost_analysis()`` of the compiled step
  is recorded beside it but not used: it counts a loop body once, and the layers, windows and blockwise
  attention are loops. A step whose attention runs kernels (Pallas: opaque to the jaxpr count) is counted as
  the same model with each method on its portable XLA implementation (:func:`portable_matmul_flops`).
* MFU = model FLOPs per token x tokens/s / peak. Peak on a CPU: this machine's measured f32 matmul rate on
  ``--matmul_n`` x ``--matmul_n`` matrices, the fastest of 3 calls after a warm-up of jax.jit(jnp.matmul)
  and of numpy, whichever is higher (``common.matmul_rate``, as ``longctx-bench attention`` records it); on a
  GPU / TPU: the device kind's dense bf16 peak
  (``common.DEVICE_PEAK_BF16_TFLOPS``); ``--peak_tflops`` overrides either. No peak (an unknown device,
  ``--matmul_n 0`` on a CPU): no MFU, and the output says why.
* device memory: ``device.memory_stats()['peak_bytes_in_use']`` after each length's compile and warm-up (the
  process's peak so far, lengths in the order given); a CPU exposes none, and the output says so.
"""

from __future__ import annotations

import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from longctx import config as config_lib
from longctx.bench import common as C
from longctx.bench import configs
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.dry_run import known_vocab
from longctx.train.optim import make_optimizer
from longctx.train.step import make_loss_fn, make_train_step, split_model


def define_flags(fv) -> None:
    flags.DEFINE_string("config", configs.DEFAULT, "config file with get_config() (FILE or FILE.py:variant; "
                        "default: configs/default.py, found in the working directory or the project)",
                        flag_values=fv)
    flags.DEFINE_string("lengths", "1k,4k,16k", "comma list of row lengths train.seq_len (k = 1024)",
                        flag_values=fv)
    flags.DEFINE_integer("batch_size", 1, "rows per step (train.batch_size)", flag_values=fv)
    flags.DEFINE_integer("window", 0, "train.window: tokens per update, state carried (0: the whole row, one "
                         "update)", flag_values=fv)
    flags.DEFINE_integer("vocab_size", None, "the tokenizer's vocabulary (default: the config's model.vocab_size, "
                         "else 256 for bytes)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed steps per length (interleaved)", flag_values=fv)
    flags.DEFINE_integer("warmup", 1, "untimed steps per length after compiling", flag_values=fv)
    flags.DEFINE_integer("matmul_n", 4096, "on a CPU, MFU's peak is the measured rate of this f32 matmul (n x n; "
                         "0: no MFU)", flag_values=fv)
    flags.DEFINE_float("peak_tflops", None, "the peak FLOP rate MFU divides by, in TFLOP/s (default: measured on a "
                       "CPU, the device's bf16 peak on a GPU / TPU)", flag_values=fv)


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
    return config_lib.resolve_vocab(cfg, vocab_size(cfg, args.vocab_size))


def vocab_size(cfg, given: int | None) -> int:
    """The vocabulary the random tokens are drawn from: ``--vocab_size``, else the one ``longctx-train --dry_run``
    knows without reading data (:func:`longctx.train.dry_run.known_vocab`: the config's own ``model.vocab_size``,
    256 for bytes, ``data.options.vocab_size`` for BPE, a tokenizer file's size); a tokenizer that learns its
    vocabulary from the data (``words``) needs the flag."""
    if given:
        return int(given)
    example = " (e.g. 267735 for WikiText-103's words)" if cfg.data.tokenizer == "words" else ""
    return known_vocab(cfg, remedy=f"give --vocab_size{example}")[0]


def forward_matmul_flops(cfg, graphdef, params, nongrad, rest, seed: int = 0) -> dict:
    """Matmul FLOPs of the model's forward pass over one step's rows (``common.jaxpr_matmul_flops`` of the
    training loss): the whole row at once, or one window with the carried state times the windows per row."""
    from flax import nnx

    tc = cfg.train
    W = tc.window or tc.seq_len
    n_windows = tc.seq_len // W
    loss = make_loss_fn(graphdef)
    toks = jnp.zeros((tc.batch_size, W), jnp.int32)
    state = (jax.eval_shape(lambda: nnx.merge(graphdef, params, nongrad, rest).init_state(tc.batch_size, tc.seq_len))
             if n_windows > 1 else None)
    if state is not None:
        state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
    out = C.jaxpr_matmul_flops(lambda p, n, r, s: loss(p, n, r, toks, toks, s, jax.random.key(seed))[0],
                               params, nongrad, rest, state)
    out["flops"] *= n_windows
    out["windows"] = n_windows
    return out


def build_step(cfg, seed: int = 0, with_extras: bool = False):
    """(compiled step, its arguments, XLA memory stats, parameter count) for a validated config; with
    ``with_extras`` a fifth item, a dict: ``compile_s`` (lowering + compiling), ``xla_flops`` (cost analysis of the compiled step) and
    ``fwd_flops`` (:func:`forward_matmul_flops`)."""

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
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if not with_extras:
        return compiled, args, C.memory_stats(compiled), n_params
    extras = {"compile_s": compile_s, "xla_flops": C.xla_flops(compiled),
              "fwd_flops": forward_matmul_flops(cfg, graphdef, params, nongrad, rest, seed)}
    if extras["fwd_flops"]["opaque"]:
        extras["fwd_flops"] = portable_matmul_flops(cfg, seed) or extras["fwd_flops"]
    return compiled, args, C.memory_stats(compiled), n_params, extras


def portable_matmul_flops(cfg, seed: int = 0) -> dict | None:
    """:func:`forward_matmul_flops` of the same model with every attention method that has Pallas kernels on the
    XLA implementation its kernels are benchmarked against (:func:`longctx.bench.common.portable_impl`; a model
    whose kernels hide their work from the jaxpr count), built abstractly (no parameters allocated); None where
    no method section has kernels."""
    from flax import nnx

    twin = cfg.copy_and_resolve_references()
    changed = {}
    for name, sec in twin.execution.attention.items():
        portable = C.portable_impl(name) if "impl" in sec else None
        if portable is not None:
            sec.impl = changed[name] = portable
    if not changed:
        return None
    model = nnx.eval_shape(lambda: build_model(twin.model, seed=twin.train.seed, execution=twin.execution))
    graphdef, params, nongrad, rest = split_model(model)
    out = forward_matmul_flops(twin, graphdef, params, nongrad, rest, seed)
    out["counted_as"] = ("the XLA implementation each method's kernels are benchmarked against ("
                        + ", ".join(f"{n}: impl={i!r}" for n, i in changed.items()) + ")")
    return out


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
    cfgs = {T: length_config(base, T, args) for T in lengths}  # every config error before any work
    res = {"header": C.header(args, "step"), "config": _shown(args.config), "sets": list(args.overrides), "rows": []}
    matmul_n = getattr(args, "matmul_n", 4096)
    peak_arg = getattr(args, "peak_tflops", None)
    if not C.accelerator() and matmul_n > 0 and peak_arg is None:  # before any compile: the CPU is quiet
        res["matmul"] = C.matmul_rate(matmul_n, repeats=3)
    res["peak"] = ({"tflops": peak_arg, "source": "--peak_tflops", "reason": None} if peak_arg is not None
                   else C.device_peak(matmul=res.get("matmul")))
    bar = C.progress_bar(len(lengths) * (1 + args.repeats), "step", args.progress)
    built = {}
    for T in lengths:
        cfg = cfgs[T]
        t0 = time.perf_counter()
        compiled, call_args, mem, n_params, extras = build_step(cfg, with_extras=True)
        extras["build_s"] = time.perf_counter() - t0
        for _ in range(args.warmup):
            C.block(compiled(*call_args))
        extras["device_mem"] = C.device_memory()
        built[T] = (compiled, call_args, mem, n_params, extras, cfg)
        bar.update(1)
    samples = {T: [] for T in lengths}
    for _ in range(args.repeats):  # interleaved: each round times every length once
        for T in lengths:
            samples[T].append(_timed(built[T][0], built[T][1]))
            bar.update(1)
    bar.close()
    peak = res["peak"].get("tflops")
    for T in lengths:
        _, _, mem, n_params, extras, cfg = built[T]
        med = statistics.median(s["s"] for s in samples[T])
        tokens = cfg.train.batch_size * T
        fwd = extras["fwd_flops"]
        per_token = 3.0 * fwd["flops"] / tokens
        achieved = per_token * tokens / med
        xf = extras["xla_flops"]
        res["rows"].append({
            "status": "ok", "T": T, "batch_size": cfg.train.batch_size, "window": cfg.train.window or T, "params": n_params,
            "step_s": med, "step_s_all": [s["s"] for s in samples[T]], "tokens_per_s": tokens / med,
            "cpu_per_wall": statistics.median(s["cpu_s"] / s["s"] for s in samples[T]),
            "sys_fraction": statistics.median(s["sys_s"] / max(s["cpu_s"], 1e-9) for s in samples[T]),
            "minor_faults": int(statistics.median(s["minflt"] for s in samples[T])),
            "xla_mem": mem, "compile_s": extras["compile_s"], "build_s": extras["build_s"],
            "attention": config_lib.attention_label(cfg.model), "block": cfg.model.block,
            "model_flops_per_token": per_token, "model_flops_counter": "3 x forward matmul FLOPs (jaxpr count)"
            + (f", counted as {fwd['counted_as']}" if fwd.get("counted_as") else ""),
            "forward_flops_while_loops": fwd["while_loops"], "forward_flops_opaque": fwd["opaque"],
            "params_6n_flops_per_token": 6.0 * n_params,
            "xla_flops_per_token": (xf["flops"] / tokens) if xf.get("flops") else None,
            "xla_flops_has_loops": xf.get("has_loops"),
            "model_tflops_per_s": achieved / 1e12, "peak_tflops": peak,
            "mfu": (achieved / (peak * 1e12)) if peak else None,
            "mfu_reason": None if peak else res["peak"].get("reason"),
            "device_peak_bytes": extras["device_mem"].get("peak_bytes_in_use"),
            "device_mem": extras["device_mem"],
        })
    C.write_json(out / "step.json", res)
    (out / "step.md").write_text(markdown(res))
    plots(res, out)
    print(markdown(res))
    print("wrote " + ", ".join(str(out / f) for f in ("step.json", "step.md", "step_tokens_per_s.png")))
    return res


def mfu_line(r: dict) -> str:
    """One line per row: tokens/s, model FLOPs per token, achieved rate, MFU (or why none), compile time and
    device memory."""
    mfu = (f"MFU {100 * r['mfu']:.2f}% of {r['peak_tflops'] * 1e3:.4g} GFLOP/s" if r.get("mfu") is not None
           else f"MFU not reported ({r.get('mfu_reason')})")
    dev = (f"device peak memory {r['device_peak_bytes'] / C.MB:,.0f} MB" if r.get("device_peak_bytes") is not None
           else f"device memory {(r.get('device_mem') or {}).get('reason', 'not available')}")
    return (f"T={C.fmt_len(r['T'])} batch={r['batch_size']}: {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['model_flops_per_token'] / 1e6:,.2f} MFLOP/token (3 x forward matmuls), "
            f"{r['model_tflops_per_s'] * 1e3:.4g} GFLOP/s, {mfu}; compile {r['compile_s']:.1f} s; {dev}")


def markdown(res: dict) -> str:
    rows = res["rows"]
    peak = res.get("peak") or {}
    head = (f"Training step (loss + gradient + update) of `{res['config']}`"
            + (f" with {', '.join('`--config.' + s + '`' for s in res['sets'])}" if res["sets"] else "")
            + f"; {rows[0]['params']:,} parameters, attention `{rows[0]['attention']}`, block `{rows[0]['block']}`; "
            f"median of {len(rows[0]['step_s_all'])} interleaved steps.\n\n")
    table = C.md_table(
        ["T", "batch", "window", "step s", "tokens/s", "MFLOP / token", "6N MFLOP / token", "GFLOP/s", "MFU %",
         "CPU s / wall s", "sys share", "minor faults / step", "XLA mem MB", "device peak MB", "compile s"],
        [[C.fmt_len(r["T"]), r["batch_size"], r["window"], r["step_s"], r["tokens_per_s"],
          r.get("model_flops_per_token", 0) / 1e6, r.get("params_6n_flops_per_token", 0) / 1e6,
          r.get("model_tflops_per_s", 0) * 1e3, 100 * r["mfu"] if r.get("mfu") is not None else None,
          r["cpu_per_wall"], r["sys_fraction"], r["minor_faults"],
          r["xla_mem"].get("total", 0) / C.MB if "total" in r["xla_mem"] else None,
          r["device_peak_bytes"] / C.MB if r.get("device_peak_bytes") is not None else None,
          r["compile_s"]] for r in rows])
    notes = ["", "Model FLOPs per token: 3 x the matrix-multiply FLOPs of the forward pass counted in its jaxpr "
             "(2·M·N·K per matmul, a scan body times its length; backward = 2 x forward, recomputation not "
             "counted), which includes the config's attention as it computes it; 6N = 6 x parameters, the "
             "parameter part of the usual formula, for comparison. MFU = model FLOPs per token x tokens/s / peak; "
             + (f"peak {peak['tflops'] * 1e3:.4g} GFLOP/s: {peak['source']}." if peak.get("tflops")
                else f"no peak: {peak.get('reason')}."),
             "Compile s: lowering + compiling the step. Device peak MB: device.memory_stats()['peak_bytes_in_use'] "
             "(the process's peak so far); "
             + (f"{rows[0]['device_mem'].get('reason')}." if rows[0].get("device_peak_bytes") is None
                and rows[0].get("device_mem") else "per length after its compile and warm-up."),
             ""]
    twins = [r for r in rows if "counted as" in r.get("model_flops_counter", "")]
    if twins:
        notes.insert(-1, "At " + ", ".join(C.fmt_len(r["T"]) for r in twins) + " the step runs kernels, whose "
                     "matmuls the jaxpr does not show: the model FLOPs are those of the same model with each "
                     "attention method on its portable XLA implementation (impl='xla').")
    loops = [r for r in rows if r.get("forward_flops_while_loops") or r.get("forward_flops_opaque")]
    if loops:
        notes.insert(-1, "Lower bound at " + ", ".join(C.fmt_len(r["T"]) for r in loops) + ": the forward has "
                     "while loops of unknown trip count (counted once) or opaque calls "
                     f"({', '.join(sorted({o for r in loops for o in r['forward_flops_opaque']})) or 'none'}).")
    return head + table + "\n".join(notes) + "\n" + "\n".join(mfu_line(r) for r in rows) + "\n"


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
