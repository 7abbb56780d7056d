"""The fusions `longctx-bench profile` would flag as XLA:CPU slow paths, per method, from the compiled module alone
(no timing): fwd+bwd of each core at batch 1, 4 heads of 64, T tokens. Usage: flagged.py T [method ...]"""
import sys

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT)]
import argparse

from longctx.bench import profile_bench as pb

T = int(sys.argv[1])
for m in sys.argv[2:] or ["dense:naive", "dense:blockwise", "eva", "transformer_vq", "fma", "kdeformer"]:
    p = argparse.ArgumentParser(); pb.add_args(p); a = p.parse_args(["--method", m])
    compiled, _, _, _ = pb._core_target(a, T)
    idx = pb.hlo_index(compiled.as_text())
    bad = [(n, r["shape"], r["source"]) for n, r in idx.items() if r["slow_path"]]
    print(m, len(bad), flush=True)
    for b in bad:
        print("   ", *b, flush=True)
