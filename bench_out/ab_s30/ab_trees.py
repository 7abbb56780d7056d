"""A/B of two source trees, one worker process each, calls alternated (ABBA...), medians. Each worker builds its
target with its own tree's `longctx-bench profile` builders. Usage:
  ab_trees.py TREE_A TREE_B REPS [profile args: --method eva --length 8k | --config F --window W --batch B ...]"""
import statistics
import subprocess
import sys

WORKER = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from longctx.host_memory import keep_freed_memory
keep_freed_memory()
import argparse, jax
from longctx.bench import profile_bench as pb, common as C
p = argparse.ArgumentParser(); pb.add_args(p); a = p.parse_args(sys.argv[2:])
T = C.parse_ints(a.length)[0]
compiled, call, _, what = (pb._step_target if a.config else pb._core_target)(a, T)
for _ in range(2): jax.block_until_ready(compiled(*call))
print("ready", what, flush=True)
for line in sys.stdin:
    t = time.perf_counter(); jax.block_until_ready(compiled(*call)); print(time.perf_counter() - t, flush=True)
'''
A, B, reps, rest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
ws = {k: subprocess.Popen([sys.executable, "-c", WORKER, t] + rest, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) for k, t in (("A", A), ("B", B))}
for k, w in ws.items():
    line = w.stdout.readline()
    while not line.startswith("ready"):
        line = w.stdout.readline()
    print(k, line.strip(), flush=True)
ts = {"A": [], "B": []}
for r in range(reps):
    for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
        ws[k].stdin.write("go\n"); ws[k].stdin.flush(); ts[k].append(float(ws[k].stdout.readline()))
for w in ws.values():
    w.stdin.close(); w.wait()
for k, v in ts.items():
    print(k, "median ms", round(1e3 * statistics.median(v), 1), "min", round(1e3 * min(v), 1), flush=True)
a, b = statistics.median(ts["A"]), statistics.median(ts["B"])
print(f"B/A {b / a:.3f}")
