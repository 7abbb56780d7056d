"""Phase A (chunk_summaries) fwd+bwd at 8k alone: wall, to size what its small dots can give."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from flax import nnx
from longctx import attention
from longctx.attention import eva
T, C, P = 8192, 1024, 8
core = attention.build("eva", attention.default_config("eva"), num_heads=4, head_dim=64, causal=True, rngs=nnx.Rngs(0))
params = core.chunk_params()
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.standard_normal((1, 4, C, P, 64)).astype(np.float32)) for _ in range(3))
valid = jnp.ones((C, P), bool)
noise = jnp.asarray(r.standard_normal((1, 4, C, 64)).astype(np.float32))
w1, w2 = (jnp.asarray(r.standard_normal((1, 4, C, 64)).astype(np.float32)) for _ in range(2))
def loss(params, q, k, v, noise, w1, w2):
    kh, b = eva.chunk_summaries(q, k, v, valid, params, noise, core.opts, 0.125)
    return jnp.sum(kh * w1) + jnp.sum(b * w2)
f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
for _ in range(3): jax.block_until_ready(f(params, q, k, v, noise, w1, w2))
ts = []
for _ in range(30):
    t = time.perf_counter(); jax.block_until_ready(f(params, q, k, v, noise, w1, w2)); ts.append(time.perf_counter() - t)
print(f"phase A fwd+bwd {np.median(ts)*1e3:.2f} ms")
if len(sys.argv) > 1:
    from pathlib import Path
    from longctx.bench import profile_bench as pb
    compiled = f.lower(params, q, k, v, noise, w1, w2).compile()
    call = (params, q, k, v, noise, w1, w2)
    ev = pb._trace(compiled, call, 5, Path("/tmp/trace_pa"))
    s = pb.summarize(ev, pb.hlo_index(compiled.as_text()), 5)
    open("/tmp/pa_hlo.txt", "w").write(compiled.as_text())
    for o in sorted(s["ops"], key=lambda o: -o["ms"])[:30]:
        print(f"{o['ms']:6.2f} {o['name']:32s} {o['shape'][:34]:34s} {o['source'][:60]} | {o.get('op_name','')[-40:]}")
