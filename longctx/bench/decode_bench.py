"""`longctx-bench decode`: per-token decoding latency and decoding-state size of every
causal method at several context positions.

Per (method, position): ``state = core.init_state(B, position)``; the state is filled by
prefill calls on ``position − warmup − steps`` random tokens in chunks of
``--prefill_chunk`` (``core(q, k, v, state)`` under jax.jit, the same path as
streaming evaluation); then ``--steps`` single-token calls ``core(q1, k1, v1, state)``
(jitted, the state fed back) are timed one by one after ``--warmup`` calls (median), so the
timed tokens are the last ones of a ``position``-token context and a core whose length is
bounded (fma's levels cover ``max_len`` tokens) is asked for no more than that.
State size = bytes of every array leaf of the state pytree after the prefill; a core keeps its KV cache in the
dtype a model of ``--dtype`` keeps it in on this platform (``precision.Policy.cache``: the compute dtype on a GPU or
TPU, float32 on a CPU).
``--model CONFIG``: the same for a config file's whole model (every layer and the output head; ``model(tokens,
state)``, random tokens) with each method as its attention, built for this platform (``model.scan_layers`` and
the caches' dtype as they resolve here): what a sampler's step costs, and whether the stacked states of scanned
layers are written in place.
A position is skipped (and says so) when XLA's compiled memory estimate of the
single-token call exceeds ``--mem_budget_gb`` or the prefill time extrapolated from
the shorter positions exceeds ``--max_prefill_s``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

from longctx import attention, config_files
from longctx import config as config_lib
from longctx.attention import dispatch
from longctx.bench import common as C
from longctx.bench.cores import CoreFns, build_core
from longctx.errors import ConfigError
from longctx.models import precision
from longctx.models.decoder import build_model


def define_flags(fv) -> None:
    flags.DEFINE_string("methods", "", "comma list of methods (default: every registered causal method)",
                        flag_values=fv)
    flags.DEFINE_string("positions", "1k,8k,32k,128k", "context positions (k = 1024)", flag_values=fv)
    C.define_qkv_flags(fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "compute dtype", flag_values=fv)
    flags.DEFINE_integer("steps", 32, "timed single-token calls", flag_values=fv)
    flags.DEFINE_integer("warmup", 3, "untimed single-token calls", flag_values=fv)
    flags.DEFINE_integer("prefill_chunk", 4096, "tokens per call of the prefill to each position", flag_values=fv)
    flags.DEFINE_float("mem_budget_gb", 16.0, "skip a position whose estimated memory exceeds this (GB)",
                       flag_values=fv)
    flags.DEFINE_float("max_prefill_s", 300.0, "stop a method's prefill past this many seconds", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the inputs", flag_values=fv)
    flags.DEFINE_string("model", "", "a config file: time its whole model's decoding step (every layer and the output "
                        "head, the layers laid out as model.scan_layers resolves on this platform) with each method "
                        "as its attention; '' (default): attention cores alone", flag_values=fv)
    flags.DEFINE_enum("scan_layers", "auto", ["auto", "on", "off"], "with --model: its layers under one scan or "
                      "unrolled ('auto': as the platform resolves it)", flag_values=fv)


def _chunk(seed, B, H, T, D, Dv, dtype):
    return C.random_qkv(seed, B, H, T, D, dtype, Dv)


def run(args) -> dict:
    out = C.out_dir(args.out)
    methods = C.select_methods(C.parse_names(args.methods))
    positions = C.parse_ints(args.positions)
    dtype = C.dtype_of(args.dtype)
    # the caches in the dtype a model of this compute dtype keeps them in on this platform (Policy.cache)
    cache = jnp.dtype(precision.Policy(compute=dtype, platform=dispatch.current_platform()).cache)
    B = args.batch
    budget = args.mem_budget_gb * C.GB
    res = {"header": C.header(args, "decode"), "rows": [], "skipped_methods": []}
    what = f"the whole model of {args.model} with " if args.model else ""
    print(f"decode: {what}{len(methods)} method(s) at positions {', '.join(C.fmt_len(p) for p in positions)}: each "
          f"prefilled to the position in chunks of {args.prefill_chunk} tokens, then {args.steps} single-token "
          f"calls timed after {args.warmup} warm-up", flush=True)
    bar = C.progress_bar(len(methods) * len(positions), "decode", args.progress)
    for method in methods:
        try:
            subject = (ModelSubject(args.model, method, args, dtype, max(positions)) if args.model else
                       CoreSubject(method, args, dtype, cache))
        except ConfigError as e:
            res["skipped_methods"].append({"method": method, "reason": " ".join(str(e).split())})
            bar.write(f"skip {method}: {e}")
            bar.update(len(positions))
            continue
        hist_L, hist_t = [], []
        for pos in positions:
            bar.set_postfix_str(f"{method} pos={C.fmt_len(pos)}")
            row = {"method": method, "position": pos, "batch": B, "dtype": args.dtype, **subject.describe}
            try:
                row.update(_one(subject, pos, args, budget, hist_L, hist_t))
            except Exception as e:  # noqa: BLE001 -- reported, the run goes on
                row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            res["rows"].append(row)
            bar.update(1)
    bar.close()
    C.write_json(out / "decode.json", res)
    (out / "decode.md").write_text(markdown(res))
    print(summary(res, out, plots(res, out)), flush=True)
    return res


def summary(res: dict, out, files: list[str]) -> str:
    """What a run prints at its end: each position's latency, state size and status, the methods not run, then
    the files it wrote."""
    rows = [[r["method"], C.fmt_len(r["position"]), 1e3 * r["per_token_s"] if r.get("per_token_s") else None,
             r["state_bytes"] / C.MB if r.get("state_bytes") else None, r.get("prefill_s"), r.get("status")]
            for r in res["rows"]]
    skipped = [f"not run: {s['method']}: {s['reason']}" for s in res["skipped_methods"]]
    wrote = ", ".join(str(Path(out) / f) for f in ["decode.json", "decode.md", *files])
    return "\n".join([C.md_table(["method", "position", "ms / token", "state MB", "prefill s", "status"], rows),
                      *skipped, f"wrote {wrote}"])


class CoreSubject:
    """One attention core (the method's default bench variant, ``--heads`` x ``--head_dim``), its KV cache in
    ``cache`` (the dtype a model keeps it in here): calls of q, k, v [B, H, n, .] on its state, the state donated."""

    def __init__(self, method: str, args, dtype, cache):
        default = attention.get_class(method).bench_variants(dispatch.current_platform()).get("")  # default variant
        core = build_core(method, default, heads=args.heads, head_dim=args.head_dim, causal=True, seed=args.seed,
                          cache_dtype=cache)
        wrapper = type(core).stack_wrapper(causal=True)
        if wrapper is not None:  # the decoding state is the wrapper's, built by the model (Backbone.init_state)
            raise ConfigError(f"its decoding state lives in its stack wrapper ({wrapper}); this benchmark times "
                              "cores alone (--model times a whole model)")
        self.core, self.fns, self.args, self.dtype = core, CoreFns(core), args, dtype
        self.fixed = (self.fns.params, self.fns.rest)
        self.jitted = jax.jit(self.fns.step(), donate_argnums=5)  # the state donated, as sampling donates it
        self.describe = {"heads": args.heads, "head_dim": args.head_dim, "cache_dtype": jnp.dtype(cache).name}

    def init_state(self, max_len: int):
        return self.core.init_state(self.args.batch, max_len)

    def inputs(self, seed: int, n: int) -> tuple:
        a = self.args
        return _chunk(seed, a.batch, a.heads, n, a.head_dim, self.core.value_dim, self.dtype)


class ModelSubject:
    """A config file's whole model with ``method`` as its attention and ``--dtype`` as its compute dtype, built for
    this platform (``model.scan_layers`` and the caches' dtype resolved here): calls of tokens [B, n] on its state,
    the state donated, the last position's logits returned."""

    def __init__(self, path: str, method: str, args, dtype, max_len: int):
        cfg = config_files.load(path)
        cfg.model.attention.name = method
        cfg.model.attention.pattern = []
        cfg.model.dtype = jnp.dtype(dtype).name
        cfg.model.scan_layers = args.scan_layers
        allowed = attention.get_class(method).allowed_positions
        if allowed is not None and cfg.model.positions not in allowed:  # the method's own position encoding
            cfg.model.positions = allowed[0]
        own = cfg.model.attention[method] if method in cfg.model.attention else {}
        if "max_len" in own and own.max_len == 0:  # a length-sized setting: 0 is the training length; here the longest
            own.max_len = max_len  # position
        options = cfg.data.options  # a trained tokenizer's size where the config names one (no data read here)
        cfg = config_lib.resolve_vocab(config_lib.validate(cfg),
                                       int(options.vocab_size) if "vocab_size" in options else 256)
        model = build_model(cfg.model, seed=args.seed, execution=cfg.execution)
        graphdef, params = nnx.split(model)

        def step(params, tokens, state):
            logits, state, _ = nnx.merge(graphdef, params)(tokens, state, deterministic=True)
            return logits[:, -1], state

        self.model, self.args, self.vocab = model, args, cfg.model.vocab_size
        self.fixed, self.jitted = (params,), jax.jit(step, donate_argnums=2)
        state = jax.eval_shape(lambda: model.init_state(1, 8))
        caches = {str(a.dtype) for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)}
        self.describe = {"model": path, "layers": cfg.model.num_layers, "scan_layers": cfg.model.scan_layers,
                         "heads": cfg.model.num_heads, "head_dim": cfg.model.head_dim, "positions": cfg.model.positions,
                         "state_dtypes": ",".join(sorted(caches))}

    def init_state(self, max_len: int):
        return self.model.init_state(self.args.batch, max_len)

    def inputs(self, seed: int, n: int) -> tuple:
        return (jax.random.randint(jax.random.PRNGKey(seed), (self.args.batch, n), 0, self.vocab, jnp.int32),)


def _one(subject, pos, args, budget, hist_L, hist_t) -> dict:
    pred = C.predict_time(hist_L, hist_t, pos, default_exponent=2.0)
    if pred is not None and pred > args.max_prefill_s:
        return {"status": f"skipped: predicted prefill {pred:.0f} s > --max_prefill_s {args.max_prefill_s:g}"}
    max_len = pos
    n_pre = pos - args.steps - args.warmup  # prefill; the decoded tokens end the context at pos
    if n_pre < 1:
        raise ValueError(f"position {pos} leaves no prefill for --warmup {args.warmup} + --steps {args.steps}")
    state = subject.init_state(max_len)
    compiled1 = subject.jitted.lower(*subject.fixed, *subject.inputs(args.seed + 1, 1), state).compile()
    mem = C.memory_stats(compiled1)
    row = {"max_len": max_len, "decode_xla_mem": mem, "state_bytes_empty": C.tree_bytes(state)}
    if mem.get("total", 0) > budget:
        row["status"] = f"skipped: XLA estimate {mem['total'] / C.GB:.1f} GB > --mem_budget_gb {args.mem_budget_gb:g}"
        return row
    # prefill in chunks
    c = min(args.prefill_chunk, n_pre)
    t0 = time.perf_counter()
    compiled = {}  # chunk length -> compiled prefill call (compiled before the prefill is timed)
    for n in {c, n_pre % c} - {0}:
        compiled[n] = subject.jitted.lower(*subject.fixed, *subject.inputs(0, n), state).compile()
    row["prefill_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    done, i = 0, 0
    with C.RssSampler() as rss:
        while done < n_pre:
            n = min(c, n_pre - done)
            _, state = compiled[n](*subject.fixed, *subject.inputs(args.seed + 100 + i, n), state)
            jax.block_until_ready(state)
            done, i = done + n, i + 1
        prefill_s = time.perf_counter() - t0
        row.update({"prefill_s": prefill_s, "prefill_calls": i, "prefill_chunk": c,
                    "state_bytes": C.tree_bytes(state)})
        # decode
        times = []
        for j in range(args.warmup + args.steps):
            inputs = subject.inputs(args.seed + 10_000 + j, 1)
            jax.block_until_ready(inputs)
            t1 = time.perf_counter()
            o, state = compiled1(*subject.fixed, *inputs, state)
            jax.block_until_ready((o, state))
            if j >= args.warmup:
                times.append(time.perf_counter() - t1)
    hist_L.append(pos)
    hist_t.append(prefill_s)
    row.update({"per_token_s": statistics.median(times), "per_token_min_s": min(times), "per_token_max_s": max(times),
                "tokens_per_s": 1.0 / statistics.median(times), "decode_steps": len(times),
                "rss_peak_bytes": rss.peak, "finite": bool(jnp.all(jnp.isfinite(o))), "status": "ok"})
    return row


def markdown(res: dict) -> str:
    a = res["header"]["args"]
    if a.get("model"):
        first = next(iter(res["rows"]), {})
        shapes = (f"The whole model of `{a['model']}` ({first.get('layers', '?')} layers, scan_layers "
                  f"{first.get('scan_layers', '?')}, states in {first.get('state_dtypes', '?')}) with each method as "
                  f"its attention: batch {a['batch']}, dtype {a['dtype']}")
    else:
        cache = next((r["cache_dtype"] for r in res["rows"] if "cache_dtype" in r), None)
        cached = f", KV caches in {cache} (as a model of that dtype keeps them here)" if cache else ""
        shapes = (f"Shapes: batch {a['batch']}, heads {a['heads']}, head_dim {a['head_dim']}, dtype {a['dtype']}"
                  f"{cached} (one attention core, not a full model)")
    parts = [f"{shapes}; prefill in chunks of {a['prefill_chunk']}; "
             f"per-token latency = median of {a['steps']} single-token calls after {a['warmup']} warm-up, the "
             f"last tokens of a context of `position` tokens (the state is built for exactly that many).\n"]
    for s in res["skipped_methods"]:
        parts.append(f"\n- `{s['method']}`: not run — {s['reason']}")
    if res["skipped_methods"]:
        parts.append("\n")
    rows = [[r["method"], C.fmt_len(r["position"]), 1e3 * r["per_token_s"] if r.get("per_token_s") else None,
             r.get("tokens_per_s"), r["state_bytes"] / C.MB if r.get("state_bytes") else None,
             r.get("prefill_s"), (r.get("decode_xla_mem") or {}).get("total", 0) / C.MB or None, r.get("status")]
            for r in res["rows"]]
    parts.append("\n" + C.md_table(["method", "position", "ms / token", "tokens/s", "state MB", "prefill s",
                                    "XLA mem (1-token call) MB", "status"], rows))
    return "".join(parts)


def plots(res: dict, out) -> list[str]:
    fig, axes = C.new_figure(2)
    for method in dict.fromkeys(r["method"] for r in res["rows"]):
        rs = sorted((r for r in res["rows"] if r["method"] == method and r.get("status") == "ok"),
                    key=lambda r: r["position"])
        if not rs:
            continue
        x = [r["position"] for r in rs]
        axes[0].plot(x, [1e3 * r["per_token_s"] for r in rs], "o-", label=method)
        axes[1].plot(x, [r["state_bytes"] / C.MB for r in rs], "o-", label=method)
    for ax, yl, t in ((axes[0], "ms per token (median)", "decoding latency"), (axes[1], "MB", "decoding state size")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context position")
        ax.set_ylabel(yl)
        ax.set_title(t)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    C.save_figure(fig, out / "decode.png")
    return ["decode.png"]
