import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R), str(_R / "scripts")]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time, collections
from pathlib import Path
from peer_eva_release import our_layer
from longctx.bench import profile_bench as pb
T=8192
params, f_fwd, f_grad = our_layer(256, 4, 128, 8, proj=True)
r=np.random.default_rng(0)
x=jnp.asarray(r.standard_normal((1,T,256)).astype(np.float32)); w=jnp.asarray(r.standard_normal((1,T,256)).astype(np.float32))
key = jax.random.key(0)
compiled = f_grad.lower(params, x, w, key).compile()
call=(params,x,w,key)
for _ in range(3): jax.block_until_ready(compiled(*call))
ts=[]
for _ in range(7):
    t=time.perf_counter(); jax.block_until_ready(compiled(*call)); ts.append(time.perf_counter()-t)
print("wall ms", np.median(ts)*1e3)
ev = pb._trace(compiled, call, 3, Path("/tmp/trace_layer"))  # scratch
idx = pb.hlo_index(compiled.as_text())
s = pb.summarize(ev, idx, 3)
print("traced", s.get("traced_op_ms_per_call"))
bysrc=collections.Counter()
for o in s["ops"]: bysrc[o["source"].split(" (an")[0]] += o["ms"]
for k,v in bysrc.most_common(25): print(round(v,2), k)
print("--- top ops")
for o in sorted(s["ops"], key=lambda o:-o["ms"])[:25]: print(round(o["ms"],2), o["name"], o["shape"], o["source"][:70])
