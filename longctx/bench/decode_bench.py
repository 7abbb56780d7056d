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

from longctx import attention
from longctx.attention import dispatch
from longctx.bench import common as C
from longctx.bench.cores import CoreFns, build_core
from longctx.errors import ConfigError
from longctx.models import precision


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


def _chunk(seed, B, H, T, D, Dv, dtype):
    return C.random_qkv(seed, B, H, T, D, dtype, Dv)


def run(args) -> dict:
    out = C.out_dir(args.out)
    methods = C.select_methods(C.parse_names(args.methods))
    positions = C.parse_ints(args.positions)
    dtype = C.dtype_of(args.dtype)
    # the caches in the dtype a model of this compute dtype keeps them in on this platform (Policy.cache)
    cache = jnp.dtype(precision.Policy(compute=dtype, platform=dispatch.current_platform()).cache)
    B, H, D = args.batch, args.heads, args.head_dim
    budget = args.mem_budget_gb * C.GB
    res = {"header": C.header(args, "decode"), "rows": [], "skipped_methods": []}
    print(f"decode: {len(methods)} method(s) at positions {', '.join(C.fmt_len(p) for p in positions)}: each "
          f"prefilled to the position in chunks of {args.prefill_chunk} tokens, then {args.steps} single-token "
          f"calls timed after {args.warmup} warm-up", flush=True)
    bar = C.progress_bar(len(methods) * len(positions), "decode", args.progress)
    for method in methods:
        try:
            default = attention.get_class(method).bench_variants(dispatch.current_platform()).get("")  # default variant
            core = build_core(method, default, heads=H, head_dim=D, causal=True, seed=args.seed, cache_dtype=cache)
        except ConfigError as e:
            res["skipped_methods"].append({"method": method, "reason": str(e)})
            bar.write(f"skip {method}: {e}")
            bar.update(len(positions))
            continue
        wrapper = type(core).stack_wrapper(causal=True)
        if wrapper is not None:  # the decoding state is the wrapper's, built by the model (Backbone.init_state)
            reason = f"its decoding state lives in its stack wrapper ({wrapper}); this benchmark times cores alone"
            res["skipped_methods"].append({"method": method, "reason": reason})
            bar.write(f"skip {method}: {reason}")
            bar.update(len(positions))
            continue
        fns = CoreFns(core)
        step = jax.jit(fns.step(), donate_argnums=5)  # the state donated, as sampling donates it
        Dv = core.value_dim
        hist_L, hist_t = [], []
        for pos in positions:
            bar.set_postfix_str(f"{method} pos={C.fmt_len(pos)}")
            row = {"method": method, "position": pos, "batch": B, "heads": H, "head_dim": D, "dtype": args.dtype,
                   "cache_dtype": cache.name}
            try:
                row.update(_one(core, fns, step, pos, args, dtype, Dv, budget, hist_L, hist_t))
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


def _one(core, fns, step, pos, args, dtype, Dv, budget, hist_L, hist_t) -> dict:
    B, H, D = args.batch, args.heads, args.head_dim
    pred = C.predict_time(hist_L, hist_t, pos, default_exponent=2.0)
    if pred is not None and pred > args.max_prefill_s:
        return {"status": f"skipped: predicted prefill {pred:.0f} s > --max_prefill_s {args.max_prefill_s:g}"}
    max_len = pos
    n_pre = pos - args.steps - args.warmup  # prefill; the decoded tokens end the context at pos
    if n_pre < 1:
        raise ValueError(f"position {pos} leaves no prefill for --warmup {args.warmup} + --steps {args.steps}")
    state = core.init_state(B, max_len)
    q1, k1, v1 = _chunk(args.seed + 1, B, H, 1, D, Dv, dtype)
    compiled1 = step.lower(fns.params, fns.rest, q1, k1, v1, state).compile()
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
        qn, kn, vn = _chunk(0, B, H, n, D, Dv, dtype)
        compiled[n] = step.lower(fns.params, fns.rest, qn, kn, vn, state).compile()
    row["prefill_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    done, i = 0, 0
    with C.RssSampler() as rss:
        while done < n_pre:
            n = min(c, n_pre - done)
            q, k, v = _chunk(args.seed + 100 + i, B, H, n, D, Dv, dtype)
            _, state = compiled[n](fns.params, fns.rest, q, k, v, state)
            jax.block_until_ready(state)
            done, i = done + n, i + 1
        prefill_s = time.perf_counter() - t0
        row.update({"prefill_s": prefill_s, "prefill_calls": i, "prefill_chunk": c,
                    "state_bytes": C.tree_bytes(state)})
        # decode
        times = []
        for j in range(args.warmup + args.steps):
            qj, kj, vj = _chunk(args.seed + 10_000 + j, B, H, 1, D, Dv, dtype)
            jax.block_until_ready((qj, kj, vj))
            t1 = time.perf_counter()
            o, state = compiled1(fns.params, fns.rest, qj, kj, vj, state)
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
    cache = next((r["cache_dtype"] for r in res["rows"] if "cache_dtype" in r), None)
    cached = f", KV caches in {cache} (as a model of that dtype keeps them here)" if cache else ""
    parts = [f"Shapes: batch {a['batch']}, heads {a['heads']}, head_dim {a['head_dim']}, dtype {a['dtype']}{cached} "
             f"(one attention core, not a full model); prefill in chunks of {a['prefill_chunk']}; "
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
