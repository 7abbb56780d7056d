"""`longctx-bench quality`: relative error ||approx − exact|| / ||exact|| (Frobenius, over the whole
[B, H, T, Dv] output) of each method against exact softmax attention (dense, naive path),
at several lengths, on

(a) ``gaussian``: standard-normal q, k, v;
(b) ``captured``: q, k, v of layer ``--layer`` of a model trained on the built-in corpus (by default a
    tiny exact-attention model, trained here if ``--workdir`` holds no checkpoint)
    (``--workdir``; a tiny run of configs/default.py with ``--train_steps`` steps is trained there
    first if it holds no checkpoint), on consecutive validation tokens.

Methods with learned parts run in the training-free settings of ``longctx/bench/dropin.py``
(or are reported 'n/a'). Randomized methods (outputs differ between two keys with
deterministic=False) also report the mean / std / min / max error over ``--seeds`` keys
``jax.random.key(seed)`` with deterministic=False; "det" is deterministic=True.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from longctx.attention.dense import naive_attention
from longctx.bench import baselines as BL
from longctx.bench import capture, dropin
from longctx.bench import common as C
from longctx.bench.cores import CoreFns, build_core, variants
from longctx.errors import ConfigError


def define_flags(fv) -> None:
    flags.DEFINE_string("methods", "", "comma list of methods or variants (default: all registered)",
                        flag_values=fv)
    flags.DEFINE_string("lengths", "1k,2k,4k,8k", "sequence lengths (k = 1024)", flag_values=fv)
    C.define_qkv_flags(fv, note="; gaussian source only (captured: the model's)")
    flags.DEFINE_bool("causal", False, "causal only (default: both directions)", flag_values=fv)
    flags.DEFINE_bool("bidirectional", False, "bidirectional only (default: both directions)", flag_values=fv)
    flags.DEFINE_integer("seeds", 5, "keys for randomized methods", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the inputs", flag_values=fv)
    flags.DEFINE_string("sources", "gaussian,captured", "gaussian and/or captured", flag_values=fv)
    flags.DEFINE_string("workdir", "runs/bench_quality", "dense checkpoint to capture q/k/v from (trained here if "
                        "it holds none)", flag_values=fv)
    flags.DEFINE_integer("train_steps", 300, "steps of the tiny dense run (if trained)", flag_values=fv)
    flags.DEFINE_integer("layer", 0, "block whose q/k/v are captured", flag_values=fv)
    flags.DEFINE_string("baselines", "performer,reformer_lsh", "benchmark-only bidirectional baselines "
                        "(longctx/bench/baselines.py); '' for none", flag_values=fv)
    flags.DEFINE_integer("budget", 128, "baselines: keys / random features per query (compare methods configured "
                         "at the same budget)", flag_values=fv)


def rel_err(a, b) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


@jax.jit
def _exact_causal(q, k, v):
    T = q.shape[2]
    pos = jnp.arange(T)
    return naive_attention(q, k, v, pos, pos, jnp.ones((T,), bool), causal=True)


@jax.jit
def _exact_bidir(q, k, v):
    T = q.shape[2]
    pos = jnp.arange(T)
    return naive_attention(q, k, v, pos, pos, jnp.ones((T,), bool), causal=False)


def run(args) -> dict:
    out = C.out_dir(args.out)
    requested = C.parse_names(args.methods)
    methods = C.select_methods(requested)
    lengths = C.parse_ints(args.lengths)
    sources = C.parse_names(args.sources) or ["gaussian"]
    res = {"header": C.header(args, "quality"), "rows": [], "not_applicable": [], "sources": {}}
    data = {}  # source -> (T -> (q, k, v, k_fit))
    maxT = max(lengths)
    if "gaussian" in sources:
        H, D = args.heads, args.head_dim
        res["sources"]["gaussian"] = {"heads": H, "head_dim": D, "batch": args.batch}
        data["gaussian"] = lambda T: (*C.random_qkv(args.seed + T, args.batch, H, T, D),
                                      C.random_qkv(args.seed + 10_000 + T, args.batch, H, T, D)[1])
    if "captured" in sources:
        print(capture_plan(args), flush=True)
        info = capture.ensure_checkpoint(args.workdir, steps=args.train_steps, sets=args.overrides, progress=args.progress)
        cap = capture.Capturer(args.workdir, layer=args.layer)
        mc = cap.cfg.model
        info.update({"step": cap.step, "layer": args.layer, "heads": mc.num_heads, "head_dim": mc.head_dim,
                     "d_model": mc.d_model, "num_layers": mc.num_layers, "valid_tokens": int(len(cap.tokens)),
                     "fit_offset": maxT, "attention": mc.attention.name, "block": mc.block,
                     "note": "q/k/v of validation tokens [0, T); drop-in setups that fit state (e.g. codebooks) use "
                     "the keys of tokens [maxT, maxT + T)"})
        res["sources"]["captured"] = info

        def cap_fn(T):
            q, k, v = cap.qkv(T, 0)
            return q, k, v, cap.qkv(T, maxT)[1]

        data["captured"] = cap_fn
    cells = [(m, lab, ov) for m in methods for lab, ov in variants(m) if C.variant_selected(requested, m, lab)]
    dirs = C.directions(args)
    bar = C.progress_bar(len(dirs) * len(cells) * len(data) * len(lengths), "quality", args.progress)
    for causal in dirs:
        dname = C.dir_name(causal)
        exact = _exact_causal if causal else _exact_bidir
        for src, get in data.items():
            for T in lengths:
                q, k, v, k_fit = get(T)
                ref = exact(q, k, v)
                H, D = q.shape[1], q.shape[-1]
                for method, label, ov in cells:
                    bar.set_postfix_str(f"{label} {dname} {src} T={C.fmt_len(T)}")
                    row = {"method": method, "variant": label, "direction": dname, "source": src, "length": T,
                           "heads": H, "head_dim": D}
                    try:
                        row.update(_one(method, ov, causal, q, k, v, k_fit, ref, args, dropin))
                    except ConfigError as e:
                        row["status"] = f"not run: {e}"
                    except Exception as e:  # noqa: BLE001
                        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    res["rows"].append(row)
                    bar.update(1)
                if not causal:
                    for name in C.parse_names(args.baselines) or []:
                        res["rows"].append(_baseline(name, src, T, q, k, v, ref, args))
    bar.close()
    C.write_json(out / "quality.json", res)
    (out / "quality.md").write_text(markdown(res))
    print(summary(res, out, plots(res, out)), flush=True)
    return res


def capture_plan(args) -> str:
    """The line said before the captured source's work: training the model it captures from (minutes), or reusing
    the checkpoint an earlier run left in ``--workdir``."""
    if capture.has_checkpoint(args.workdir):
        return f"quality: capturing q/k/v from the model already trained in {args.workdir} (reused)"
    return (f"quality: training the capture model first: {args.train_steps} steps of a tiny dense model into "
            f"{args.workdir} (reused by later runs; --sources gaussian skips it)")


def summary(res: dict, out, files: list[str]) -> str:
    """What a run prints at its end: each cell's error and status, then the files it wrote."""
    rows = [[r["variant"], r["direction"], r["source"], C.fmt_len(r["length"]), r.get("rel_err"),
             r.get("rel_err_mean"), "ok" if r.get("status") == "ok" else r.get("status")] for r in res["rows"]]
    wrote = ", ".join(str(Path(out) / f) for f in ["quality.json", "quality.md", *files])
    return "\n".join([C.md_table(["variant", "direction", "source", "T", "rel err (det)", "rel err (seeds mean)",
                                  "status"], rows), f"wrote {wrote}"])


def _one(method, ov, causal, q, k, v, k_fit, ref, args, dropin) -> dict:
    H, D = q.shape[1], q.shape[-1]
    spec, desc = dropin.resolve(method, ov, heads=H, head_dim=D, causal=causal)
    if spec is None:
        return {"setting": desc, "status": desc}
    core = build_core(method, spec.overrides, heads=H, head_dim=D, causal=causal, seed=args.seed)
    qi, ki, vi = q, k, v
    if spec.setup is not None:
        qi, ki, vi = spec.setup(core, q, k, v, k_fit, args.seed)
    fns = CoreFns(core)
    det = jax.jit(fns.forward())(fns.params, fns.rest, qi, ki, vi)
    row = {"setting": spec.description, "rel_err": rel_err(det, ref), "finite": bool(jnp.all(jnp.isfinite(det))),
           "rel_err_op": BL.op_rel_err(det, ref)}
    rnd = jax.jit(fns.forward_random())
    o0 = rnd(fns.params, fns.rest, qi, ki, vi, jax.random.key(0))
    o1 = rnd(fns.params, fns.rest, qi, ki, vi, jax.random.key(1))
    randomized = not bool(jnp.array_equal(o0, o1))
    row["randomized"] = randomized
    if randomized and args.seeds > 0:
        errs = [rel_err(o0, ref) if s == 0 else rel_err(o1, ref) if s == 1 else
                rel_err(rnd(fns.params, fns.rest, qi, ki, vi, jax.random.key(s)), ref) for s in range(args.seeds)]
        ops = [BL.op_rel_err(o0 if s == 0 else o1 if s == 1 else
                             rnd(fns.params, fns.rest, qi, ki, vi, jax.random.key(s)), ref) for s in range(args.seeds)]
        row.update({"rel_err_op_mean": statistics.fmean(ops), "rel_err_op_std": statistics.pstdev(ops)})
        row.update({"rel_err_seeds": errs, "rel_err_mean": statistics.fmean(errs),
                    "rel_err_std": statistics.pstdev(errs) if len(errs) > 1 else 0.0,
                    "rel_err_min": min(errs), "rel_err_max": max(errs)})
    row["status"] = "ok"
    return row


def _baseline(name, src, T, q, k, v, ref, args) -> dict:
    """One benchmark-only baseline row (bidirectional): errors over --seeds keys (at least one)."""
    H, D = q.shape[1], q.shape[-1]
    row = {"method": f"baseline:{name}", "variant": f"baseline:{name}", "direction": C.dir_name(False),
           "source": src, "length": T, "heads": H, "head_dim": D}
    try:
        fn = jax.jit(BL.make(name, args.budget))
        outs = [fn(q, k, v, jax.random.key(s)) for s in range(max(args.seeds, 1))]
        errs = [rel_err(o, ref) for o in outs]
        ops = [BL.op_rel_err(o, ref) for o in outs]
        row.update({"setting": BL.describe(name, args.budget), "rel_err": errs[0], "rel_err_op": ops[0],
                    "randomized": True, "finite": bool(jnp.all(jnp.isfinite(outs[0]))),
                    "rel_err_seeds": errs, "rel_err_mean": statistics.fmean(errs),
                    "rel_err_std": statistics.pstdev(errs) if len(errs) > 1 else 0.0,
                    "rel_err_min": min(errs), "rel_err_max": max(errs),
                    "rel_err_op_mean": statistics.fmean(ops), "rel_err_op_std": statistics.pstdev(ops),
                    "status": "ok"})
    except Exception as e:  # noqa: BLE001
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def markdown(res: dict) -> str:
    a = res["header"]["args"]
    parts = []
    for src, info in res["sources"].items():
        if src == "gaussian":
            parts.append(f"- gaussian: standard-normal q, k, v, batch {info['batch']}, heads {info['heads']}, "
                         f"head_dim {info['head_dim']}.\n")
        else:
            parts.append(f"- captured: layer {info['layer']} of a model with `{info.get('attention', '?')}` attention "
                         f"(`{info.get('block', '?')}` blocks, d_model {info['d_model']}, "
                         f"{info['num_layers']} layers, {info['heads']} heads × {info['head_dim']}) trained "
                         f"{info['step']} steps on the built-in corpus (`{info['workdir']}`); {info['note']}.\n")
    settings = {}
    for r in res["rows"]:
        if r.get("setting"):
            settings.setdefault(r["method"], r["setting"])
    parts.append("\nSettings (training-free drop-in, see longctx/bench/dropin.py):\n\n")
    for m, s in settings.items():
        parts.append(f"- `{m}`: {s}\n")
    parts.append(f"\nRandomized methods: deterministic=False over {a['seeds']} keys (mean ± std [min, max]); "
                 "'det' = deterministic=True.\n")
    headers = ["variant", "source", "T", "rel err (det)", "rel err over seeds", "op-norm err (det / key 0)",
               "op-norm err over seeds", "status"]
    for dname in dict.fromkeys(r["direction"] for r in res["rows"]):
        rows = []
        for r in (r for r in res["rows"] if r["direction"] == dname):
            seeds = None
            if r.get("rel_err_mean") is not None:
                seeds = (f"{r['rel_err_mean']:.3g} ± {r['rel_err_std']:.2g} "
                         f"[{r['rel_err_min']:.3g}, {r['rel_err_max']:.3g}]")
            status = r.get("status")
            op_seeds = None
            if r.get("rel_err_op_mean") is not None:
                op_seeds = f"{r['rel_err_op_mean']:.3g} ± {r['rel_err_op_std']:.2g}"
            rows.append([r["variant"], r["source"], C.fmt_len(r["length"]), r.get("rel_err"), seeds,
                         r.get("rel_err_op"), op_seeds, "ok" if status == "ok" else status])
        parts.append(f"\n### {dname}\n\n" + C.md_table(headers, rows))
    return "".join(parts)


def plots(res: dict, out) -> list[str]:
    files = []
    srcs = list(dict.fromkeys(r["source"] for r in res["rows"]))
    for dname in dict.fromkeys(r["direction"] for r in res["rows"]):
        fig, axes = C.new_figure(max(1, len(srcs)))
        for ax, src in zip(axes, srcs):
            rs = [r for r in res["rows"] if r["direction"] == dname and r["source"] == src and r.get("rel_err") is not None]
            for lab in dict.fromkeys(r["variant"] for r in rs):
                pts = sorted((r["length"], r["rel_err"], r.get("rel_err_mean"), r.get("rel_err_std"))
                             for r in rs if r["variant"] == lab)
                x = [p[0] for p in pts]
                y = [max(p[1], 1e-12) for p in pts]
                line = ax.plot(x, y, "o-", label=f"{lab} (det)")[0]
                if all(p[2] is not None for p in pts):
                    ax.errorbar(x, [p[2] for p in pts], yerr=[p[3] for p in pts], fmt="s--", color=line.get_color(),
                                label=f"{lab} (seeds)", capsize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("relative error vs exact")
            ax.set_title(f"{src}, {dname}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        C.save_figure(fig, out / f"quality_{dname}.png")
        files.append(f"quality_{dname}.png")
    return files
