"""A/B one attention method's file at a git revision against the working tree's, interleaved in one process.

On this kind of machine the same jitted function can run 10-15 % faster or slower from one process to the
next, so a change worth a few percent only shows when both versions run side by side. This script loads the
method's module (its file only, e.g. ``longctx/attention/eva.py``) as it was at ``--old`` under another module
name, builds the core from both versions with the same config and parameters, and alternates their calls:
forward, and forward+backward of sum(out * w) with respect to the parameters and q, k, v. Medians and minima
are reported, with the largest difference between the two versions' gradients (relative to the largest
gradient entry), so a change meant to reorder the same arithmetic shows that it did.

    .venv/bin/python scripts/ab_core.py --method eva --old HEAD~1 --lengths 8k,16k --repeats 9

Everything except the method's own file (helpers, kernels' references) comes from the working tree, so an old
revision whose file imports a helper that has since changed may not load. Writes ab_core.json and ab_core.md
under --out. Run as a script, the process takes the entry points' host memory settings (longctx/host_memory.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def old_class(target: str, rev: str):
    """The class ``module:Class`` as its module's file was at git revision ``rev``."""
    module_name, cls_name = target.split(":")
    rel = module_name.replace(".", "/") + ".py"
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="ab_core_")) / Path(rel).name
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(module_name + "_ab_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return getattr(mod, cls_name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", required=True)
    p.add_argument("--old", required=True, help="git revision of the method's file to compare against")
    p.add_argument("--lengths", default="8k")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--out", default="bench_out/ab_core")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from longctx import attention

    causal = not a.bidirectional
    cfg = attention.default_config(a.method)
    classes = {"old": old_class(attention._METHODS[a.method], a.old), "new": attention.get_class(a.method)}
    rows = []
    for T in [parse_len(s) for s in a.lengths.split(",")]:
        shape = (a.batch, a.heads, T, a.head_dim)
        q, k, v, w = (jax.random.normal(jax.random.key(i), shape) for i in range(4))
        fns = {}
        for side, cls in classes.items():
            core = cls(cfg, num_heads=a.heads, head_dim=a.head_dim, causal=causal, rngs=nnx.Rngs(0))
            gd, params, rest = nnx.split(core, nnx.Param, ...)

            def out(params, q, k, v, gd=gd, rest=rest):
                return nnx.merge(gd, params, rest)(q, k, v)[0]

            def grad(params, q, k, v, out=out, w=w):
                return jax.grad(lambda *xs: jnp.sum(out(*xs) * w), argnums=(0, 1, 2, 3))(params, q, k, v)

            fns[f"{side} fwd"] = (jax.jit(out), params)
            fns[f"{side} fwd+bwd"] = (jax.jit(grad), params)
        for f, params in fns.values():
            for _ in range(a.warmup):
                jax.block_until_ready(f(params, q, k, v))
        times = {name: [] for name in fns}
        for _ in range(a.repeats):
            for name, (f, params) in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(f(params, q, k, v))
                times[name].append(time.perf_counter() - t)
        g_old, g_new = (jax.tree.leaves(fns[f"{s} fwd+bwd"][0](fns[f"{s} fwd+bwd"][1], q, k, v)) for s in ("old", "new"))
        diff = max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)) for x, y in zip(g_old, g_new))
        row = {"T": T, "grad_max_rel_diff": diff, "times": times,
               **{f"{n} median ms": float(np.median(t)) * 1e3 for n, t in times.items()},
               **{f"{n} min ms": float(np.min(t)) * 1e3 for n, t in times.items()}}
        rows.append(row)
        print(json.dumps({k_: (round(v_, 2) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                          if k_ != "times"}), flush=True)

    lines = [f"{a.method}, {'causal' if causal else 'bidirectional'}, old = {a.old}, medians (min) of {a.repeats} "
             "interleaved calls, ms", "",
             "| T | old fwd | new fwd | old fwd+bwd | new fwd+bwd | new / old fwd+bwd | gradient max rel diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cell = lambda n, r=r: f"{r[n + ' median ms']:,.1f} ({r[n + ' min ms']:,.1f})"  # noqa: E731
        ratio = r["new fwd+bwd median ms"] / r["old fwd+bwd median ms"]
        lines.append(f"| {r['T'] // 1024}k | {cell('old fwd')} | {cell('new fwd')} | {cell('old fwd+bwd')} | "
                     f"{cell('new fwd+bwd')} | {ratio:.3f} | {r['grad_max_rel_diff']:.1e} |")
    md = "\n".join(lines)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv, "jax": jax.__version__}
    (out / "ab_core.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "ab_core.md").write_text(md + "\n")


if __name__ == "__main__":
    from longctx.host_memory import keep_freed_memory, restart_with_huge_pages

    restart_with_huge_pages()
    keep_freed_memory()
    main()
