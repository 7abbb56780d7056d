"""Trace the EVA peer layer's 8k fwd+bwd (N calls) and print thread time per XLA op name (top 40) and per thread."""
import collections
import sys
import tempfile
import glob

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import jax
import peer_eva_release as P
import os, importlib.util
if os.environ.get('PATCH'):
    spec = importlib.util.spec_from_file_location('patch', os.environ['PATCH']); patch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patch); patch.apply()

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
N = int(sys.argv[2]) if len(sys.argv) > 2 else 5
params, f_fwd, f_grad = P.our_layer(256, 4, 128, 8)
x = jax.random.normal(jax.random.key(1), (1, T, 256)); w = jax.random.normal(jax.random.key(2), (1, T, 256))
for _ in range(3):
    jax.block_until_ready(f_grad(params, x, w))
d = tempfile.mkdtemp()
with jax.profiler.trace(d):
    for _ in range(N):
        jax.block_until_ready(f_grad(params, x, w))
open(os.environ.get("OPS", "/tmp/prof_ops.json") + ".hlo", "w").write(f_grad.lower(params, x, w).compile().as_text())
f = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
pd = jax.profiler.ProfileData.from_file(f)
tot = collections.Counter(); cnt = collections.Counter(); per_line = collections.Counter()
for plane in pd.planes:
    for line in plane.lines:
        for ev in line.events:
            tot[ev.name] += ev.duration_ns; cnt[ev.name] += 1; per_line[(plane.name, line.name)] += ev.duration_ns
for (pl, ln), ns in per_line.most_common(12):
    print(f"{ns / N / 1e6:9.2f} ms  {pl} / {ln}")
print()
for name, ns in tot.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 50):
    print(f"{ns / N / 1e6:8.2f} ms  x{cnt[name] / N:5.1f}  {name[:110]}")
print()
import re
cat = collections.Counter(); leaf = collections.Counter()
for plane in pd.planes:
    for line in plane.lines:
        if "Eigen" not in line.name and "PjRt" not in line.name:
            continue
        for ev in line.events:
            if ev.name.startswith("ThunkExecutor") or ev.name.startswith("$") or "Pjit" in ev.name:
                continue
            k = re.sub(r"\.\d+$", "", ev.name)
            cat[k] += ev.duration_ns; leaf[line.name] += ev.duration_ns
for k, ns in cat.most_common(25):
    print(f"{ns / N / 1e6:8.2f} ms  {k}")
for k, ns in leaf.items():
    print(f"leaf time on {k}: {ns / N / 1e6:.1f} ms")
import json
json.dump({k: v / N / 1e6 for k, v in tot.items()}, open(os.environ.get("OPS", "/tmp/prof_ops.json"), "w"))
