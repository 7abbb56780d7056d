"""In-process A/B of the EVA peer layer: A = current code, B = with patches from a module (apply()). NOPROJ=1: the cores
without the projections. Usage: eva_ab.py PATCH.py T REPEATS."""
import importlib.util
import statistics
import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import jax
import peer_eva_release as P

T = int(sys.argv[2]); reps = int(sys.argv[3])
spec = importlib.util.spec_from_file_location("patch", sys.argv[1]); patch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch)
x = jax.random.normal(jax.random.key(1), (1, T, 256)); w = jax.random.normal(jax.random.key(2), (1, T, 256))
fns = {}
PROJ = __import__("os").environ.get("NOPROJ") is None
pa, _, ga = P.our_layer(256, 4, 128, 8, proj=PROJ); ra = jax.block_until_ready(ga(pa, x, w)); fns["A"] = (ga, pa)
patch.apply()
pb, _, gb = P.our_layer(256, 4, 128, 8, proj=PROJ); rb = jax.block_until_ready(gb(pb, x, w)); fns["B"] = (gb, pb)
diff = max(float(abs(a - b).max()) if a.shape == b.shape else -1.0 for a, b in zip(jax.tree.leaves(ra), jax.tree.leaves(rb)))
print("max |grad A - grad B|", diff, flush=True)
for k, (g, p) in fns.items(): jax.block_until_ready(g(p, x, w))
ts = {"A": [], "B": []}
for r in range(reps):
    for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
        g, p = fns[k]; t = time.perf_counter(); jax.block_until_ready(g(p, x, w)); ts[k].append(time.perf_counter() - t)
for k, v in ts.items():
    print(k, "median ms", round(1e3 * statistics.median(v), 1), "min", round(1e3 * min(v), 1))
