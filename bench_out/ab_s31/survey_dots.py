#!/usr/bin/env python
import sys, re, argparse
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from longctx.bench import profile_bench as pb
import jax
def top_dots(text):
    depth=0; out=[]
    cur=None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = "entry" if m[1] else m[2]; continue
        if line == "}": cur=None; continue
        if cur and (cur=="entry" or cur.startswith("region") or "body" in cur or "cond" in cur or "while" in cur or "wide" in cur) and re.search(r"\} dot\(", line):
            out.append((cur, re.sub(r",? ?metadata=.*","",line.strip())[:230]))
        elif cur and not cur.startswith("fused") and re.search(r"\} dot\(", line):
            out.append((cur, re.sub(r",? ?metadata=.*","",line.strip())[:230]))
    return out
for spec in sys.argv[2:]:
    p = argparse.ArgumentParser(); pb.add_args(p)
    a = p.parse_args(["--method", spec, "--length", sys.argv[1], "--batch", "1", "--heads", "4", "--head_dim", "64"])
    compiled, call, _, what = pb._core_target(a, int(sys.argv[1]))
    ds = top_dots(compiled.as_text())
    print(f"== {spec}: {len(ds)} top-level dots")
    for c, l in ds: print("  ", c[:30], l)
