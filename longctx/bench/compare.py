"""`longctx-bench compare`: which method should I use? Every causal method trained at equal parameters and equal
training cost on the same corpus, at several training contexts and seeds, then scored the same way.

    longctx-bench compare --plan                       # the runs, their steps and estimated time; nothing runs
    longctx-bench compare --measure                    # time a few steps of each method at the chosen size
    longctx-bench compare                              # train / resume what is missing, then the report
    longctx-bench compare --report_only                # the report from whatever finished
    longctx-bench compare --scale gpu --seeds 1 --nohybrids --out results/compare_gpu --runs runs/compare_gpu
                                                       # a lent GPU (sizes by estimate: see SCALES)

Runs: each method of ``--methods`` (the registry's causal methods: exact attention, sliding-window attention over
``--window`` keys, the efficient methods) at each context of ``--contexts`` and each seed below ``--seeds``, plus
with ``--hybrids`` one hybrid per method but the exact one (its layers with the last one exact,
``model.attention.pattern``; sliding-window attention's is a local/global model)
at seed 0 and the longest context. Every run is trained from ``configs/builtin/<method>.py`` (or
configs/default.py) with the scale's sizes, the same tokens per update at every context (batch = tokens / context)
and ``--config.KEY=VALUE`` overrides (e.g. ``--config.data.source=files --config.data.path=DIR``). Equal parameters
(``--match_params``): each run's feed-forward width ``model.d_ff`` (GAU blocks: the value width
``gau_expansion * d_model``) is set so a count of its parameters is the closest to the exact run's. ``backbone``
(the default) counts the parameters outside the attention cores (embeddings, projections, feed-forward, norms): every
run has the exact run's backbone, and a core's own parameters (FMA's downsampling kernels, EVA's feature
projections, Transformer-VQ's relative-position terms) come on top, reported in their own column and paid for in
FLOPs. ``total`` counts every parameter: at small widths it takes a method's own parameters out of its feed-forward
(at the CPU scale fma_linear's would leave it 8 wide), so the method's feed-forward, not its attention, is compared;
``none`` keeps each config's widths. The rest of each method's config (depth, heads, its own attention settings) is
its own.

Equal training cost is equal training FLOPs: the budget is the dense run's ``--dense_steps`` updates at that
context, and each run gets ``round(budget / (FLOPs per token x tokens per update))`` updates, its FLOPs per token
counted as ``longctx-bench step`` counts them (3 x the forward's matmul FLOPs in the jaxpr). Wall time is reported
beside it (measured on a shared machine it is noisy, hence not the budget).

Nothing is lost on interruption: each run trains in its own folder ``<runs>/<label>_ctx<T>_seed<s>`` (the trainer
resumes from its newest checkpoint; ``--runs`` defaults to the untracked ``runs/compare``) and its scores are written
last, to ``<out>/results/<label>_ctx<T>_seed<s>.json``; a rerun skips finished runs. The report (``compare.md``,
``compare.json``, PNGs) is rebuilt from whatever finished and names the missing runs. Per run: validation and test bits per byte (``longctx-eval``'s scoring, a bounded number of bytes),
test bits per byte by position in the context, passkey answer loss by distance (``longctx-recall``, zero-shot on
the text model), training tokens/s. Per method: decoding cost per token of its core (``longctx-bench decode``);
a needle grid (``longctx-recall`` ``needle_grid``) for exact and sliding-window attention and one efficient method from seed 0 at
the longest context.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from absl import flags

from longctx import attention
from longctx import config as config_lib
from longctx.bench import common as C
from longctx.bench import configs, decode_bench
from longctx.bench.step_bench import _timed, build_step, forward_matmul_flops, portable_matmul_flops, vocab_size
from longctx.bench.train_bench import read_metrics
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.step import split_model

# the registry's causal methods: the exact one first, the sliding-window one next, then the efficient ones
EXACT = next(n for n in attention.names() if attention.get_class(n).exact)
WINDOW = next(n for n in attention.names() if attention.get_class(n).sliding_window)
CAUSAL = tuple(n for n in attention.names() if attention.get_class(n).supports_causal and n not in (EXACT, WINDOW))
METHODS = (EXACT, WINDOW, *CAUSAL)
NEEDLE = (EXACT, WINDOW, CAUSAL[0])  # a needle grid for the exact baselines and one efficient method


def _hybrid_ok(method: str) -> bool:
    """A hybrid (the method in every layer but the last, exact attention there) needs the plain loop of blocks:
    not the exact baselines, nor a method that runs the blocks in its own stack wrapper."""
    return method != EXACT and not attention.get_class(method).stack_wrapper(causal=True)
# Every scale: rows inside one document (data.packing='document'), whatever the default ('auto'): packed rows
# cost each method its own layout (docs/methods/*.md, "Packed rows"), which the equal-FLOP budget would not see.
DATA = {"data.packing": "document"}
# Sizes per scale: model overrides, contexts, tokens per update, the dense run's updates (the FLOP budget),
# evaluation bytes. cpu: a small model (about 0.2M parameters: at a fixed CPU budget it trains further than a wider
# one; d_model 64 reached 3.00 validation bits per byte where d_model 128 reached 4.25 at the same training FLOPs),
# updates of 4096 tokens (2048 ran fewer tokens per second), about three hours of a 2-core CPU for 8 methods x 2
# contexts x 3 seeds + 6 hybrids
# (the estimate comes from `--measure`, `--plan` prints it). gpu: sized by estimate for one lent H100 in bf16, never
# run on one yet: a 3.2M-parameter model whose dense run at 4k is ~0.2 PFLOP of training (about a second at a third
# of the bf16 peak), so each run's time is mostly compilation and scoring; with --seeds 1 --nohybrids (16 runs)
# that should take minutes, not hours (an estimate, never measured). `--measure` on the GPU first says how long,
# `--plan` then estimates the whole.
SCALES = {
    "cpu": {"model": {"model.d_model": 64, "model.num_heads": 2, "model.head_dim": 32, "model.d_ff": 256},
            "contexts": "256,1k", "tokens_per_step": 4096, "dense_steps": 300, "eval_tokens": 32768,
            "valid_every": 8},
    "gpu": {"model": {"model.d_model": 256, "model.num_layers": 4, "model.d_ff": 1024, "model.num_heads": 4,
                      "model.head_dim": 64, "model.dtype": "bfloat16"},
            "contexts": "1k,4k", "tokens_per_step": 32768, "dense_steps": 150, "eval_tokens": 65536,
            "valid_every": 8},
    "smoke": {"model": {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 2, "model.head_dim": 32,
                        "model.d_ff": 256},
              "contexts": "128", "tokens_per_step": 512, "dense_steps": 6, "eval_tokens": 2048, "valid_every": 2,
              "window": 64},  # below its context, so the sliding window is not exact attention
}
DEFAULT_WINDOW = 128  # the sliding-window method's window where a scale names none




def define_flags(fv) -> None:
    flags.DEFINE_string("out", "results/compare", "output folder (runs, JSON, markdown, PNG), relative to the "
                        "working directory", flag_values=fv)
    flags.DEFINE_string("runs", "runs/compare", "the runs' training folders (checkpoints; not for the repository), "
                        "relative to the working directory", flag_values=fv)
    flags.DEFINE_enum("scale", "cpu", sorted(SCALES), "sizes (see SCALES in this module)", flag_values=fv)
    flags.DEFINE_string("methods", ",".join(METHODS), "comma list",
                        flag_values=fv)
    flags.DEFINE_string("contexts", None, "training contexts (k = 1024); default: the scale's", flag_values=fv)
    flags.DEFINE_integer("seeds", 3, "seeds 0 .. seeds-1 per (method, context)", flag_values=fv)
    flags.DEFINE_enum("match_params", "backbone", list(MATCH), "equal parameters: each run's feed-forward (or GAU "
                      "value) width set so its parameters outside the attention cores (backbone) or all of them "
                      "(total) are closest to the exact run's; none: each config's own widths",
                      flag_values=fv)
    flags.DEFINE_bool("hybrids", True, "the hybrid runs (--nohybrids: none)", flag_values=fv)
    flags.DEFINE_integer("window", 0, f"the sliding-window method's window (keys); 0: the scale's ({DEFAULT_WINDOW}, "
                         "smoke: 64)", flag_values=fv)
    flags.DEFINE_integer("dense_steps", 0, "updates of the dense run (the FLOP budget); 0: scale's", flag_values=fv)
    flags.DEFINE_integer("tokens_per_step", 0, "tokens per update at every context; 0: scale's", flag_values=fv)
    flags.DEFINE_integer("eval_tokens", None, "bytes scored per split; default: the scale's", flag_values=fv)
    flags.DEFINE_string("needle", ",".join(NEEDLE), "methods given a needle grid ('' for none)", flag_values=fv)
    flags.DEFINE_bool("plan", False, "print the plan; run nothing", flag_values=fv)
    flags.DEFINE_bool("measure", False, "time --measure_steps steps of each method and context (written to "
                      "<out>/sizing.json, read by --plan); no training", flag_values=fv)
    flags.DEFINE_integer("measure_steps", 3, "steps timed per method and context by --measure", flag_values=fv)
    flags.DEFINE_bool("report_only", False, "rebuild the report from the finished runs", flag_values=fv)
    flags.DEFINE_string("readme", "", "also write the 'which method to pick' table between this file's "
                        f"{README_START} and {README_END} markers (README.md's 'Pick a method')", flag_values=fv)


def validate(args) -> None:
    bad = [m for m in C.parse_names(args.methods) or () if m not in METHODS]
    if bad or not C.parse_names(args.methods):
        raise ConfigError(f"--methods {args.methods!r}: choose from {', '.join(METHODS)}")
    if args.contexts is not None:
        try:
            vals = C.parse_ints(args.contexts)
        except ValueError:
            vals = []
        if not vals or any(v <= 0 for v in vals):
            raise ConfigError(f"--contexts {args.contexts!r}: positive lengths such as 256,1k")
    if args.measure_steps < 1:
        raise ConfigError(f"--measure_steps {args.measure_steps}: must be a positive integer")
    for name in ("window", "dense_steps", "tokens_per_step"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name} {getattr(args, name)}: must be >= 0 (0: the scale's)")
    if args.readme:  # checked before anything trains: the table is written at the end
        path = Path(args.readme)
        if not path.is_file():
            raise ConfigError(f"--readme={args.readme}: no such file")
        body = path.read_text()
        if README_START not in body or README_END not in body:
            raise ConfigError(f"--readme={args.readme}: no {README_START} ... {README_END} markers in it")


def window(args) -> int:
    """The sliding-window method's window: ``--window``, else the scale's."""
    return args.window or SCALES[args.scale].get("window", DEFAULT_WINDOW)


# ----------------------------------------------------------------------------- the runs
def sizes(args) -> dict:
    s = dict(SCALES[args.scale])
    contexts = C.parse_ints(args.contexts or s["contexts"])
    return {"contexts": contexts, "tokens_per_step": args.tokens_per_step or s["tokens_per_step"],
            "dense_steps": args.dense_steps or s["dense_steps"], "eval_tokens": args.eval_tokens or s["eval_tokens"],
            "model": s["model"], "valid_every": s["valid_every"]}


def runs(args) -> list[dict]:
    """Every run of the comparison: ``{label, method, hybrid, context, seed, dir}``, in the order they train (every
    method once per context before the next seed, so a cut-short comparison has whole seeds; the hybrids after the
    second seed, the first with a spread)."""
    sz = sizes(args)
    methods = C.parse_names(args.methods)
    out = []
    for seed in range(args.seeds):
        for T in sz["contexts"]:
            for m in methods:
                out.append({"label": m, "method": m, "hybrid": False, "context": T, "seed": seed})
        if args.hybrids and seed == min(args.seeds, 2) - 1:
            out += [{"label": f"hybrid_{m}", "method": m, "hybrid": True, "context": max(sz["contexts"]), "seed": 0}
                    for m in methods if _hybrid_ok(m)]
    for r in out:
        r["dir"] = str(Path(args.runs) / f"{r['label']}_ctx{r['context']}_seed{r['seed']}")
    return out


def result_path(args, run: dict) -> Path:
    """Where a finished run's scores live: ``<out>/results/<run folder name>.json`` (small, kept with the report,
    so ``--report_only`` rebuilds it without the checkpoints)."""
    return Path(args.out) / "results" / f"{Path(run['dir']).name}.json"


def run_config(run: dict, args, steps: int | None = None):
    """The resolved training config of one run (``steps`` updates; None: one, for counting and timing)."""

    sz = sizes(args)
    cfg, _ = configs.method_config(run["method"])
    cfg = configs.with_overrides(cfg, [f"{k}={v}" for k, v in {**sz["model"], **DATA}.items()])
    if run["method"] == WINDOW:
        cfg.model.attention[WINDOW].window = window(args)
    if run["hybrid"]:
        L = cfg.model.num_layers
        cfg.model.attention.pattern = tuple([run["method"]] * (L - 1) + [EXACT])
    T = run["context"]
    tc = cfg.train
    tc.seq_len = T
    tc.window = 0
    tc.batch_size = max(1, sz["tokens_per_step"] // T)
    tc.seed = run["seed"]
    n = steps or 100  # counting and timing only: long enough for the warm-up
    tc.steps = n
    every = max(1, n // sz["valid_every"])
    tc.eval_every = every
    tc.ckpt_every = every
    tc.log_every = max(1, min(every, n // 20 or 1))
    tc.warmup_steps = max(1, min(tc.warmup_steps, n // 10))
    tc.async_checkpoints = False
    tc.eval_tokens = min(tc.eval_tokens, sz["eval_tokens"])
    cfg.eval.max_tokens, cfg.eval.max_bytes = 0, sz["eval_tokens"]  # the same bytes whatever the tokenizer
    cfg = configs.with_overrides(cfg, getattr(args, "overrides", []))
    cfg = config_lib.validate(cfg)
    if args.match_params != "none" and run["method"] != EXACT:
        exact = {"label": EXACT, "method": EXACT, "hybrid": False, "context": run["context"], "seed": run["seed"]}
        part = MATCH[args.match_params]
        cfg = match_params(cfg, param_count(run_config(exact, args), part), part)
    return cfg


def _widths(cfg) -> tuple[str, int, int]:
    """The width that equalises parameters: (its key, its value, its step): the feed-forward width ``model.d_ff``
    of transformer blocks, or the GAU value width ``gau_expansion * d_model`` (a multiple of the heads)."""
    m = cfg.model
    if m.block == "gau":
        return "model.gau_expansion", int(round(m.gau_expansion * m.d_model)), 8 * m.num_heads
    return "model.d_ff", int(m.d_ff), 8


def _with_width(cfg, key: str, width: int):
    value = width / cfg.model.d_model if key == "model.gau_expansion" else width
    return config_lib.validate(configs.with_overrides(cfg, [f"{key}={value}"]))


def match_params(cfg, target: int, part: str = "all"):
    """``cfg`` with the width of :func:`_widths` set so its parameters (``part`` of them, :func:`param_count`) are
    closest to ``target`` (the exact run's): they are affine in that width, so two counts give it, rounded to the
    width's step."""
    key, w0, step = _widths(cfg)
    p0, p1 = param_count(cfg, part), param_count(_with_width(cfg, key, w0 + step), part)
    if p1 == p0:
        return cfg
    w = max(step, step * round((w0 + (target - p0) * step / (p1 - p0)) / step))
    return cfg if w == w0 else _with_width(cfg, key, w)


# --match_params: which parameters are made equal (param_count's part)
MATCH = {"backbone": "backbone", "total": "all", "none": None}
_PARAMS: dict[str, dict[str, int]] = {}


def param_count(cfg, part: str = "all") -> int:
    """Trainable parameters of ``cfg``'s model (built abstractly; cached per config): ``all`` of them, the
    attention cores' own (``core``: the parameters under a block's ``core``), or the rest (``backbone``)."""
    import jax
    import numpy as np
    from flax import nnx

    sig = cfg.model.to_json(sort_keys=True)
    if sig not in _PARAMS:
        cfg = _with_vocab(cfg)
        model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0, execution=cfg.execution))
        leaves = jax.tree_util.tree_flatten_with_path(split_model(model)[1])[0]
        n = {"all": 0, "core": 0}
        for path, x in leaves:
            size = int(np.prod(x.shape))
            n["all"] += size
            n["core"] += size if any(getattr(k, "key", None) == "core" for k in path) else 0
        _PARAMS[sig] = {**n, "backbone": n["all"] - n["core"]}
    return _PARAMS[sig][part]


def _with_vocab(cfg):
    """``cfg`` with its vocabulary resolved as ``longctx-bench step`` resolves it (the trainer does it itself)."""

    return config_lib.resolve_vocab(cfg, vocab_size(cfg, None))


def flops_per_token(cfg) -> dict:
    """Training FLOPs per token as ``longctx-bench step`` counts them: 3 x the forward's matmul FLOPs (jaxpr), the
    model built abstractly; a method whose kernels hide their work is counted on its portable XLA program."""
    import jax
    import numpy as np
    from flax import nnx

    cfg = _with_vocab(cfg)
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=cfg.train.seed, execution=cfg.execution))
    graphdef, params, nongrad, rest = split_model(model)
    fwd = forward_matmul_flops(cfg, graphdef, params, nongrad, rest)
    if fwd["opaque"]:
        fwd = portable_matmul_flops(cfg) or fwd
    tokens = cfg.train.batch_size * cfg.train.seq_len
    return {"flops_per_token": 3.0 * fwd["flops"] / tokens, "params": int(sum(np.prod(x.shape) for x in
                                                                             jax.tree.leaves(params)))}


def _key(run: dict) -> str:
    return f"{run['label']}_ctx{run['context']}"


def signature(args) -> str:
    """What makes two runs of one label, context and seed the same run: the sizes, data rule, overrides, window
    and parameter matching."""
    return json.dumps({"sizes": sizes(args), "data": DATA, "overrides": list(getattr(args, "overrides", [])),
                       "window": window(args), "match_params": args.match_params}, sort_keys=True)


def check_signature(args) -> None:
    """``<out>/signature.json`` holds the signature of the runs the folder's results come from: a command with
    another one is refused in one line (finished runs are skipped and reported by name, so mixing sizings would
    mix results silently)."""
    path = Path(args.out) / "signature.json"
    sig = json.loads(signature(args))
    if path.is_file():
        held = json.loads(path.read_text())
        if held != sig:
            diff = sorted(k for k in set(held) | set(sig) if held.get(k) != sig.get(k))
            raise ConfigError(f"{args.out} holds the results of runs with other settings ({', '.join(diff)} differ): "
                              "use another --out and --runs, or remove that folder's results")
    else:
        C.out_dir(args.out)
        path.write_text(json.dumps(sig, indent=1, sort_keys=True) + "\n")


def costs(args, rs: list[dict], *, write: bool = True) -> dict:
    """FLOPs per token and parameters of every (label, context), cached in ``<out>/costs.json`` for the settings of
    its signature (another signature's cache is neither read nor, with ``write=False``, replaced)."""
    path = Path(args.out) / "costs.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    sig = signature(args)
    if cache.get("signature") != sig:
        cache = {"signature": sig, "rows": {}}
    added = False
    for r in rs:
        k = _key(r)
        if k not in cache["rows"]:
            cache["rows"][k] = flops_per_token(run_config(r, args))
            added = True
    if write and added:
        C.out_dir(args.out)
        path.write_text(json.dumps(cache, indent=1))
    return cache["rows"]


def steps_for(run: dict, args, cost: dict) -> int:
    """Updates of one run at the equal FLOP budget of the dense run's ``dense_steps`` at its context."""
    sz = sizes(args)
    dense = cost[f"{EXACT}_ctx{run['context']}"]["flops_per_token"] if f"{EXACT}_ctx{run['context']}" in cost else None
    mine = cost[_key(run)]["flops_per_token"]
    if not dense:
        return sz["dense_steps"]
    return max(1, round(sz["dense_steps"] * dense / mine))


# ----------------------------------------------------------------------------- plan and sizing
def measure(args, rs: list[dict]) -> dict:
    """Seconds per update of each (label, context): ``--measure_steps`` timed steps after one (compile) step."""

    path = Path(args.out) / "sizing.json"
    seen, rows = set(), {}
    for r in rs:
        if _key(r) in seen:
            continue
        seen.add(_key(r))
        cfg = _with_vocab(run_config(r, args))
        t0 = time.perf_counter()
        compiled, call_args, _, _ = build_step(cfg)
        compile_s = time.perf_counter() - t0
        C.block(compiled(*call_args))
        times = [_timed(compiled, call_args)["s"] for _ in range(args.measure_steps)]
        rows[_key(r)] = {"step_s": statistics.median(times), "all_s": times, "compile_s": compile_s}
        print(f"{_key(r)}: {rows[_key(r)]['step_s']:.3f} s / update (median of {len(times)}), compile "
              f"{compile_s:.1f} s", flush=True)
    res = {"header": C.header(args, "compare --measure"), "rows": rows,
           "note": "timed on a machine shared with other work: noisy"}
    C.write_json(path, res)
    return res


def plan(args, rs: list[dict]) -> dict:
    cost = costs(args, rs, write=False)  # a plan runs and writes nothing
    sizing_path = Path(args.out) / "sizing.json"
    sizing = json.loads(sizing_path.read_text())["rows"] if sizing_path.is_file() else {}
    rows, total, left = [], 0.0, 0
    for r in rs:
        n = steps_for(r, args, cost)
        s = sizing.get(_key(r))
        est = n * s["step_s"] + s["compile_s"] if s else None
        done = result_path(args, r).is_file()
        left += not done
        total += 0.0 if done else (est or 0.0)
        rows.append([r["label"], r["context"], r["seed"], cost[_key(r)]["params"],
                     cost[_key(r)]["flops_per_token"] / 1e6, n, est / 60 if est else None,
                     "done" if done else "to run"])
    where = Path(args.out) / "results"
    if left == 0:
        todo = (f"every run has its result in {where} (the results committed there count: --out DIR trains them "
                "anew in DIR)")
    else:
        todo = (f"{len(rs) - left} have their result in {where}; " + (
            f"estimated training time of the {left} left {total / 3600:.2f} h (scoring adds a few minutes per run; "
            "timings on a shared machine are noisy)" if sizing else
            f"{left} left, their training time not estimated yet (--measure times a few steps of each first)"))
    text = (f"{len(rs)} runs; training FLOPs per run = the dense run's {sizes(args)['dense_steps']} updates at its "
            f"context; {todo}\n\n"
            + C.md_table(["run", "context", "seed", "params", "MFLOP/token", "updates", "est. min", "status"], rows))
    print(text)
    return {"rows": rows, "estimated_s": total, "text": text}


# ----------------------------------------------------------------------------- one run
def train_and_score(run: dict, args, steps: int) -> dict:
    """Train (or resume) one run in a child process (``longctx.bench.train_worker``), then score it; writes
    its scores (:func:`result_path`) last, so a run without them is resumed by the next call."""
    from longctx.evaluate import evaluate_run, write_json_atomic  # deferred: bench --help start-up: no orbax
    from longctx.recall import recall_run  # deferred: bench --help start-up: no orbax

    wd = Path(run["dir"])
    wd.mkdir(parents=True, exist_ok=True)
    cfg = run_config(run, args, steps)
    (wd / "compare_config.json").write_text(cfg.to_json(indent=1))
    if not (wd / "bench_result.json").is_file():
        cmd = [sys.executable, "-m", "longctx.bench.train_worker", str(wd / "compare_config.json"), str(wd),
               str(wd / "bench_result.json")]
        with open(wd / "train.log", "a") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = (wd / "train.log").read_text().strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"training exited {rc}: {tail[0][:200]} (see {wd / 'train.log'})")

    trained = json.loads((wd / "bench_result.json").read_text())
    res = {**run, "steps": steps, "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len, "width": _widths(cfg)[1],
           "params": trained["summary"].get("params"), "core_params": param_count(cfg, "core"), "train_wall_s": trained.get("train_wall_s"),
           **read_metrics(wd), "curve": _curve(wd)}
    over = {"eval.max_tokens": 0, "eval.max_bytes": sizes(args)["eval_tokens"]}
    for split in ("valid", "test"):
        e = evaluate_run(wd, split=split, overrides=over, progress=False)
        res[f"{split}_bits_per_byte"] = e.get("bits_per_byte", e["bits_per_token"])
        if split == "test":
            res["test_by_position"] = e["by_position"]
    rec = recall_run(wd, task="passkey", length=run["context"], rows=16, bins=4, progress=False,
                     out=wd / "recall")
    res["passkey"] = {k: rec.get(k) for k in ("status", "accuracy", "bits_per_token", "by_distance", "message")}
    result_path(args, run).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result_path(args, run), res)
    return res


def _curve(wd: Path) -> list[list[float]]:
    recs = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [[r["step"], r["bits_per_token"]] for r in recs if r["split"] == "valid" and "bits_per_token" in r]


def decode_costs(args, out: Path) -> None:
    """Decoding cost per token of each method's core (``longctx-bench decode``) at the comparison's contexts, the
    model's heads and head size; written to ``<out>/decode/``; skipped when there."""

    if (out / "decode" / "decode.json").is_file():
        return
    cfg = run_config({"label": EXACT, "method": EXACT, "hybrid": False, "context": 256, "seed": 0}, args)
    methods = sorted(set(C.parse_names(args.methods)))
    ns = SimpleNamespace(out=str(out / "decode"), progress=False, methods=",".join(methods),
                         positions=",".join(str(t) for t in sizes(args)["contexts"]), batch=1,
                         heads=cfg.model.num_heads, head_dim=cfg.model.head_dim, dtype="float32", steps=16,
                         warmup=2, prefill_chunk=1024, mem_budget_gb=8.0, max_prefill_s=120.0, seed=0,
                         command="decode")
    decode_bench.run(ns)


def needle_grids(args, rs: list[dict], out: Path) -> None:
    from longctx.recall import needle_grid  # deferred: bench --help start-up: no orbax

    wanted = C.parse_names(args.needle) or []
    T = max(sizes(args)["contexts"])
    for r in rs:
        if r["label"] in wanted and r["context"] == T and r["seed"] == 0 and result_path(args, r).is_file():
            folder = out / "needle" / r["label"]
            if not list(folder.glob("needle_grid_*.json")):
                needle_grid(r["dir"], sorted({max(64, T // 4), max(64, T // 2), T}), task="passkey", rows=16, bins=4,
                            progress=False, out=folder)


# ----------------------------------------------------------------------------- the command
def run(args) -> dict:
    rs = runs(args)
    if args.plan:
        return plan(args, rs)
    out = C.out_dir(args.out)
    if args.measure:
        return measure(args, rs)
    check_signature(args)
    if not args.report_only:
        cost = costs(args, rs)
        for i, r in enumerate(rs):
            if result_path(args, r).is_file():
                continue
            print(f"[{i + 1}/{len(rs)}] {r['label']} context {r['context']} seed {r['seed']}", flush=True)
            try:
                train_and_score(r, args, steps_for(r, args, cost))
            except (RuntimeError, ConfigError) as e:
                print(f"  failed: {e} (a rerun resumes it)", flush=True)
            needle_grids(args, rs, out)  # as soon as a grid's run is scored, not after every seed
        needle_grids(args, rs, out)
        decode_costs(args, out)
    return report(out, rs, args)


# ----------------------------------------------------------------------------- the report
def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _pm(m, sd, n) -> str:
    if m is None:
        return "–"
    return f"{m:.4f}" + (f" ± {sd:.4f}" if sd is not None else "") + f" ({n})"


def _margin(a: dict, b: dict) -> str:
    """``b``'s test bits per byte less ``a``'s, and whether it is clear (larger than their seed spreads added)."""
    d = b["test_bits_per_byte"] - a["test_bits_per_byte"]
    sa, sb = a.get("test_bits_per_byte_sd"), b.get("test_bits_per_byte_sd")
    if sa is None or sb is None:
        return f"{d:+.3f} (one seed)"
    return f"{d:+.3f} ({'clear' if abs(d) > sa + sb else 'within the spread'})"


README_START, README_END = "<!-- compare-pick:start -->", "<!-- compare-pick:end -->"


def update_readme(path: Path, text: str) -> None:
    """Replace what lies between ``path``'s compare markers with ``text``; a file without them is refused."""
    body = path.read_text()
    if README_START not in body or README_END not in body:
        raise ConfigError(f"--readme={path}: no {README_START} ... {README_END} markers in it")
    head, rest = body.split(README_START, 1)
    path.write_text(head + README_START + "\n" + text.strip() + "\n" + README_END + rest.split(README_END, 1)[1])


def pick_table(rows: list[dict]) -> str:
    """Per context: the runs ranked by test bits per byte (seed means), the best one's margin over the next, over
    exact attention and over sliding-window attention."""
    out = []
    for T in sorted({r["context"] for r in rows}):
        ranked = sorted((r for r in rows if r["context"] == T and r["test_bits_per_byte"] is not None),
                        key=lambda r: r["test_bits_per_byte"])
        if not ranked:
            continue
        best = ranked[0]
        ref = {r["label"]: r for r in ranked}
        cells = [T, best["label"], _pm(best["test_bits_per_byte"], best["test_bits_per_byte_sd"], len(best["seeds"])),
                 f"{ranked[1]['label']} {_margin(best, ranked[1])}" if len(ranked) > 1 else "–"]
        cells += [_margin(best, ref[b]) if b in ref and b != best["label"] else "–" for b in (EXACT, WINDOW)]
        cells.append(ranked[0]["label"] + "".join(  # equal at the table's 4 decimals: a tie, not an order
            (" = " if round(b["test_bits_per_byte"], 4) == round(a["test_bits_per_byte"], 4) else " < ") + b["label"]
            for a, b in zip(ranked, ranked[1:])))
        out.append(cells)
    if not out:
        return ""
    return C.md_table(["context", "best", "its test bits/byte", "next, and the margin", f"{EXACT}'s margin",
                       f"{WINDOW}'s margin", "order (best first)"], out)


def aggregate(results: list[dict]) -> list[dict]:
    """One row per (label, context): means and sample standard deviations over the finished seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["label"], r["context"]), []).append(r)
    rows = []
    for (label, T), rs in groups.items():
        row = {"label": label, "context": T, "seeds": sorted(r["seed"] for r in rs), "params": rs[0].get("params"),
               "core_params": rs[0].get("core_params"), "width": rs[0].get("width"),
               "steps": rs[0].get("steps")}
        for k in ("valid_bits_per_byte", "test_bits_per_byte", "tokens_per_s", "train_wall_s", "flops_per_token"):
            row[k], row[k + "_sd"] = _mean_sd([r.get(k) for r in rs])
        rows.append(row)
    return sorted(rows, key=lambda r: (r["context"], r["label"]))


def _scale_line(rows: list[dict], sz: dict, match: str = "backbone") -> str:
    """The comparison's size in a few words: parameters, tokens of the exact run, contexts."""
    dense = [r for r in rows if r["label"] == EXACT]
    n = f"{dense[0]['params'] / 1e6:.2f}M" if dense and dense[0].get("params") else ""
    params = ("" if not n else f"the exact run's {n}-parameter backbone in every run (a method's own parameters "
              "on top), " if match == "backbone" else f"{n}-parameter models, ")
    return (f"{params}the exact run's {sz['dense_steps']} updates of {sz['tokens_per_step']:,} tokens as every run's "
            "FLOP budget; other scales can order the methods differently")


MATCH_TEXT = {
    "backbone": "Equal parameters outside the attention cores: each run's feed-forward width (GAU blocks: value width) "
                "is set so its backbone (embeddings, projections, feed-forward, norms) has the exact run's parameters; "
                "a core's own parameters come on top (the core params column) and are paid for in FLOPs. ",
    "total": "Equal parameters: each run's feed-forward width (GAU blocks: value width) is set so all its parameters "
             "are the closest to the exact run's (the FF / GAU width column). ",
    "none": "Each config's own widths (parameters not matched). ",
}


def command(args) -> str:
    """The command that reproduces the comparison: every setting that differs from its default."""
    flag = {"methods": ",".join(METHODS), "contexts": None, "seeds": 3, "match_params": "backbone", "hybrids": True,
            "window": 0, "dense_steps": 0, "tokens_per_step": 0, "eval_tokens": None, "needle": ",".join(NEEDLE)}
    parts = [f"longctx-bench compare --scale {args.scale} --out {args.out} --runs {args.runs}"]
    for name, default in flag.items():
        value = getattr(args, name, default)
        if value != default:
            parts.append((f"--{name}" if value else f"--no{name}") if isinstance(value, bool) else
                         f"--{name} {value if value != '' else chr(39) * 2}")
    return " ".join(parts) + "".join(f" --config.{o}" for o in getattr(args, "overrides", []))


def report(out: Path, rs: list[dict], args) -> dict:
    cost_path = out / "costs.json"
    cache = json.loads(cost_path.read_text()) if cost_path.is_file() else {}
    cost = cache.get("rows", {}) if cache.get("signature") == signature(args) else {}  # only these settings' FLOPs
    done, missing = [], []
    for r in rs:
        p = result_path(args, r)
        if p.is_file():
            res = json.loads(p.read_text())
            res["flops_per_token"] = (cost.get(_key(r)) or {}).get("flops_per_token")
            if "core_params" not in res:  # results written before the column existed
                res["core_params"] = param_count(run_config(r, args), "core")
            done.append(res)
        else:
            missing.append(r)
    rows = aggregate(done)
    sz = sizes(args)
    cmd = command(args)
    parts = [f"`{cmd}` (resumable: rerun it to train what is missing). {len(done)} of {len(rs)} runs finished. "
             f"Equal training FLOPs: every run's budget is the dense run's {sz['dense_steps']} updates of "
             f"{sz['tokens_per_step']} tokens at its context (FLOPs per token = 3 x forward matmul FLOPs, as "
             "`longctx-bench step` counts them); wall time is reported beside it, measured on a shared machine "
             "(noisy). "
             + MATCH_TEXT[args.match_params]
             + f"Bits per byte: mean ± sample standard deviation (seeds) over {sz['eval_tokens']} bytes of "
             "each split."
             + "".join(f" No hybrid_{m}: its blocks run inside the method's own stack wrapper, which a pattern "
                       "cannot mix." for m in C.parse_names(args.methods)
                       if getattr(args, "hybrids", True) and m != EXACT and not _hybrid_ok(m))
             + "\n\n"]
    if missing:
        parts.append("Missing runs: " + ", ".join(f"`{r['label']}` ctx {r['context']} seed {r['seed']}"
                                                   for r in missing) + ".\n\n")
    pick = pick_table(rows)
    pick_text = ("Which method to pick at this scale (test bits per byte at equal training FLOPs, seed mean ± "
                 "sample standard deviation; a margin is called clear when it exceeds the two runs' standard "
                 "deviations added, and needs at least two seeds of each):\n\n" + pick + "\n\n")
    if pick:
        parts.append(pick_text)
    if args.readme and pick:
        update_readme(Path(args.readme), f"From `{cmd}` ({len(done)} of {len(rs)} runs; "
                      f"{_scale_line(rows, sz, args.match_params)}). " + pick_text)
    table = [[r["label"], r["context"], r["params"], r["core_params"], r["width"], r["steps"],
              r["flops_per_token"] / 1e6 if r["flops_per_token"] else None,
              _pm(r["valid_bits_per_byte"], r["valid_bits_per_byte_sd"], len(r["seeds"])),
              _pm(r["test_bits_per_byte"], r["test_bits_per_byte_sd"], len(r["seeds"])),
              r["tokens_per_s"], r["train_wall_s"] / 60 if r["train_wall_s"] else None] for r in rows]
    parts.append(C.md_table(["run", "context", "params", "core params", "FF / GAU width", "updates", "train MFLOP/token", "valid bits/byte",
                             "test bits/byte", "train tokens/s", "train min"], table))
    settle = ranking_table(done)
    if settle:
        parts.append("\nHas the ranking settled? Validation bits per byte (seed mean) at fractions of each run's "
                     "FLOP budget, and the order of the runs at each (best first):\n\n" + settle)
    pos = position_table(done)
    if pos:
        parts.append("\nTest bits per byte by position in the context (seed mean; does the method use distant "
                     "tokens?):\n\n" + pos)
    rec = passkey_table(done)
    if rec:
        parts.append("\nPasskey answer loss (bits per token) by distance, zero-shot on the text models (seed "
                     "mean; a model that reads far back keeps it low at long distances):\n\n" + rec)
    dec = out / "decode" / "decode.md"
    if dec.is_file():
        parts.append("\nDecoding cost per token of each method's attention core (`longctx-bench decode` at the "
                     "model's heads and head size; the sliding-window method at its default window):\n\n" + dec.read_text())
    for md in sorted(out.glob("needle/*/needle_grid_*.md")):
        parts.append(f"\n`{md.parent.name}`: " + md.read_text())
        parts += [f"\n![{p.stem}]({p.relative_to(out)})\n" for p in sorted(md.parent.glob("needle_grid_*.png"))]
    text = "".join(parts)
    res = {"rows": rows, "results": done, "missing": missing}
    C.write_json(out / "compare.json", res)
    if done:
        plots(done, rows, out)
        text += "\n![bits per byte against cost](compare.png)\n\n![validation curves](compare_curves.png)\n"
    (out / "compare.md").write_text(text)
    print(text)
    wrote = [out / "compare.md", out / "compare.json"] + ([out / "compare.png", out / "compare_curves.png"] if done
                                                            else [])
    print("wrote " + ", ".join(map(str, wrote)) + (f"; the pick table in {args.readme}" if args.readme and pick
                                                    else ""))
    return res


def _avg_bins(lists: list[list[dict]], key: str) -> list[tuple[str, float]]:
    out: dict[tuple, list[float]] = {}
    for bins in lists:
        for b in bins:
            if b.get(key) is not None:
                out.setdefault((b["lo"], b["hi"]), []).append(b[key])
    return [(f"{lo}-{hi}", statistics.fmean(v)) for (lo, hi), v in sorted(out.items())]


FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _at_fraction(curve: list[list[float]], steps: int, f: float) -> float | None:
    """The validation point of ``curve`` ([step, bits]) nearest to fraction ``f`` of ``steps`` updates."""
    if not curve or not steps:
        return None
    return min(curve, key=lambda p: abs(p[0] / steps - f))[1]


def ranking_table(done: list[dict]) -> str:
    """Per context: each run's seed-mean validation bits at :data:`FRACTIONS` of its budget, then the order of the
    runs at each fraction and whether it changed over the last half of the budget."""
    by: dict[tuple, list[dict]] = {}
    for r in done:
        if r.get("curve"):
            by.setdefault((r["label"], r["context"]), []).append(r)
    parts = []
    for T in sorted({t for _, t in by}):
        labels = sorted(label for label, t in by if t == T)
        mean = {}
        for label in labels:
            for f in FRACTIONS:
                vals = [v for r in by[(label, T)] if (v := _at_fraction(r["curve"], r["steps"], f)) is not None]
                mean[(label, f)] = statistics.fmean(vals) if vals else None
        rows = [[label] + [mean[(label, f)] for f in FRACTIONS] for label in labels]
        order = {f: [x for x in sorted(labels, key=lambda lb: mean[(lb, f)]) if mean[(x, f)] is not None]
                 for f in FRACTIONS}
        lines = [f"- {round(100 * f)} %: " + " < ".join(order[f]) for f in FRACTIONS]
        same = order[0.5] == order[0.75] == order[1.0]
        parts.append(f"Context {T}:\n\n" + C.md_table(["run"] + [f"{round(100 * f)} %" for f in FRACTIONS], rows)
                     + "\n" + "\n".join(lines) + "\n\nThe order over the last half of the budget: "
                     + ("unchanged." if same else "still changing (more updates could change the ranking).") + "\n")
    return "\n".join(parts)


def position_table(done: list[dict]) -> str:
    by: dict[tuple, list] = {}
    for r in done:
        if r.get("test_by_position"):
            by.setdefault((r["label"], r["context"]), []).append(r["test_by_position"])
    return _bins_table(by, "bits_per_token", 6)


def passkey_table(done: list[dict]) -> str:
    by: dict[tuple, list] = {}
    for r in done:
        pk = r.get("passkey") or {}
        if pk.get("status") == "ok":
            bins = [dict(b, bits=b["loss_nats_per_token"] / math.log(2)) for b in pk["by_distance"]
                    if b.get("loss_nats_per_token") is not None]
            by.setdefault((r["label"], r["context"]), []).append(bins)
    return _bins_table(by, "bits", 4)


def _bins_table(by: dict, key: str, most: int) -> str:
    """One table per context: a row per run label, columns = at most ``most`` of the bins (the last ones kept)."""
    parts = []
    for T in sorted({t for _, t in by}):
        labels = sorted(label for label, t in by if t == T)
        avg = {label: _avg_bins(by[(label, T)], key) for label in labels}
        cols = list(dict.fromkeys(c for label in labels for c, _ in avg[label]))
        keep = sorted(set(cols[:: max(1, math.ceil(len(cols) / most))]) | {cols[-1]}, key=cols.index) if cols else []
        rows = [[label] + [dict(avg[label]).get(c) for c in keep] for label in labels]
        parts.append(f"Context {T}:\n\n" + C.md_table(["run"] + keep, rows))
    return "\n".join(parts)


def plots(done: list[dict], rows: list[dict], out: Path) -> None:
    fig, axes = C.new_figure(2)
    labels = sorted({r["label"] for r in rows})
    for i, label in enumerate(labels):
        rs = [r for r in rows if r["label"] == label and r["valid_bits_per_byte"] is not None]
        for ax, key in ((axes[0], "flops_per_token"), (axes[1], "tokens_per_s")):
            pts = [(r[key] if key == "flops_per_token" else 1.0 / r[key], r["valid_bits_per_byte"], r["context"])
                   for r in rs if r.get(key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i % 10}", label=label)
                for x, y, T in pts:
                    ax.annotate(C.fmt_len(T), (x, y), fontsize=7)
    for ax, xl in ((axes[0], "training FLOPs per token"), (axes[1], "training seconds per token (wall, noisy)")):
        ax.set_xscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("validation bits per byte (seed mean)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    C.save_figure(fig, out / "compare.png")
    contexts = sorted({r["context"] for r in done})
    fig, axes = C.new_figure(len(contexts))
    for ax, T in zip(axes, contexts):
        for i, label in enumerate(labels):
            for r in (r for r in done if r["label"] == label and r["context"] == T and r.get("curve")):
                per_step = (r.get("flops_per_token") or 0.0) * r["tokens_per_step"]
                ax.plot([s * per_step for s, _ in r["curve"]], [b for _, b in r["curve"]], color=f"C{i % 10}",
                        label=label if r["seed"] == min(x["seed"] for x in done if x["label"] == label) else None)
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("validation bits per byte")
        ax.set_title(f"context {T}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    C.save_figure(fig, out / "compare_curves.png")
