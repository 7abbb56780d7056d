"""A/B: transformer_vq causal_blocks backward from kept weights (KEEP_MAX_SCORES default) vs recomputed (0),
whole-model train step at the release's shape, one process, alternating."""
import argparse
import statistics
import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import peer_tvq_release as P

from longctx.attention import transformer_vq as tvq
from longctx.bench import common as C
from longctx.bench import configs, step_bench

ap = argparse.ArgumentParser(); ap.add_argument("--T", type=int, default=16384); ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--thr", type=int, default=None)
a = ap.parse_args()
base = configs.with_overrides(configs.load_config_file(str(configs.REPO / "configs/builtin/transformer_vq.py")), P.OUR_SETS)
ns = argparse.Namespace(batch_size=1, window=0, vocab_size=256)
default = tvq.KEEP_MAX_SCORES if a.thr is None else a.thr
built = {}
for name, thr in (("keep", default), ("recompute", 0)):
    tvq.KEEP_MAX_SCORES = thr
    cfg = step_bench.length_config(base, a.T, ns)
    t0 = time.perf_counter()
    compiled, args, mem, _ = step_bench.build_step(cfg)
    C.block(compiled(*args)); C.block(compiled(*args))
    built[name] = (compiled, args)
    print(name, "thr", thr, "compile+2 warm", round(time.perf_counter() - t0, 1), "s; XLA mem", mem, flush=True)
times = {k: [] for k in built}
for r in range(a.reps):
    order = list(built) if r % 2 == 0 else list(built)[::-1]
    for k in order:
        t = step_bench._timed(*built[k]); times[k].append(t["s"])
    print(r, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
for k, v in times.items():
    print(k, "median", round(statistics.median(v), 3), "min", round(min(v), 3), [round(x, 3) for x in v])
