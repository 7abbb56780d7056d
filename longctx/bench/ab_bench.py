"""`longctx-bench ab`: one attention core or training step built by two source trees (e.g. two
``git worktree`` checkouts of different commits), timed in two worker processes whose calls alternate
(A B B A ...), medians and minima reported. Machine load drifts from one process to the next; a change
worth a few percent only shows when both versions run side by side like this.

    longctx-bench ab TREE_A TREE_B --method eva --length 8k --reps 15
    longctx-bench ab TREE_A TREE_B --config configs/default.py --length 1k --batch 8 --window 256

Each worker imports ``longctx`` from its own tree (TREE/longctx) and builds the target with that tree's
``longctx-bench profile`` builders, so both trees must have them. Writes ab.json and ab.md under --out.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from absl import flags

from longctx.bench import common as C
from longctx.bench import profile_bench
from longctx.errors import ConfigError

_TARGET_ARGS = ("method", "config", "length", "batch", "window", "heads", "head_dim", "dtype", "bidirectional",
                "forward_only", "seed", "overrides")

WORKER = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from longctx.host_memory import keep_freed_memory
keep_freed_memory()
import types, jax
from longctx.bench import common as C, profile_bench as pb
a = types.SimpleNamespace(**json.loads(sys.argv[2]))
a.set = a.overrides  # the spelling of older trees
T = C.parse_ints(a.length)[0]
compiled, call, _, what = (pb._step_target if a.config else pb._core_target)(a, T)
for _ in range(2):
    jax.block_until_ready(compiled(*call))
print("ready", what, flush=True)
for line in sys.stdin:
    t = time.perf_counter(); jax.block_until_ready(compiled(*call)); print(time.perf_counter() - t, flush=True)
'''


# positional arguments, taken from what is left of the command line after the flags
POSITIONALS = (("tree_a", "source tree A (a folder holding longctx/)"),
               ("tree_b", "source tree B (a folder holding longctx/)"))


def define_flags(fv) -> None:
    flags.DEFINE_integer("reps", 15, "timed calls per tree (alternated)", flag_values=fv)
    profile_bench.define_target_flags(fv)  # the target of longctx-bench profile


def validate(args) -> None:
    for name in ("tree_a", "tree_b"):
        if not (Path(getattr(args, name)) / "longctx" / "__init__.py").is_file():
            raise ConfigError(f"{getattr(args, name)}: not a source tree (no longctx/__init__.py in it)")
    profile_bench.validate(args)


def _readline(w, what: str) -> str:
    line = w.stdout.readline()
    if not line:
        raise ConfigError(f"the worker of tree {what} ended early (exit {w.wait()}); run it alone with "
                          "longctx-bench profile to see why")
    return line


def run(args) -> dict:
    out = C.out_dir(args.out)
    target = json.dumps({k: getattr(args, k) for k in _TARGET_ARGS})
    trees = {"A": str(Path(args.tree_a).resolve()), "B": str(Path(args.tree_b).resolve())}
    workers = {k: subprocess.Popen([sys.executable, "-c", WORKER, t, target], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True) for k, t in trees.items()}
    times = {"A": [], "B": []}
    try:
        what = {}
        for k, w in workers.items():
            line = _readline(w, k)
            while not line.startswith("ready"):
                line = _readline(w, k)
            what[k] = line[len("ready "):].strip()
        bar = C.progress_bar(2 * args.reps, "ab", args.progress)
        for r in range(args.reps):
            for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
                workers[k].stdin.write("go\n")
                workers[k].stdin.flush()
                times[k].append(float(_readline(workers[k], k)))
                bar.update(1)
        bar.close()
    finally:
        for w in workers.values():
            if w.stdin and not w.stdin.closed:
                w.stdin.close()
            w.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"header": C.header(args, "ab"), "trees": trees, "target": what["A"],
           "rows": [{"tree": k, "path": trees[k], "median_s": med[k], "min_s": min(times[k]), "times": times[k]}
                    for k in ("A", "B")],
           "b_over_a": med["B"] / med["A"]}
    C.write_json(out / "ab.json", res)
    md = markdown(res)
    (out / "ab.md").write_text(md)
    print(md)
    return res


def markdown(res: dict) -> str:
    rows = [[r["tree"], f"`{r['path']}`", f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}"] for r in res["rows"]]
    return (f"A/B of the {res['target']} ({len(res['rows'][0]['times'])} alternated calls per tree)\n\n"
            + C.md_table(["tree", "path", "median ms", "min ms"], rows)
            + f"\n\nB / A (medians): {res['b_over_a']:.3f}\n")
