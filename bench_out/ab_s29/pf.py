import resource, sys, time
sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"), str(__import__("pathlib").Path(__file__).resolve().parents[2])]
from longctx.host_memory import keep_freed_memory
keep_freed_memory()
import jax, peer_eva_release as P
params, f_fwd, f_grad = P.our_layer(256, 4, 128, 8)
x = jax.random.normal(jax.random.key(1), (1, 8192, 256)); w = jax.random.normal(jax.random.key(2), (1, 8192, 256))
for _ in range(3): jax.block_until_ready(f_grad(params, x, w))
r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
for _ in range(10): jax.block_until_ready(f_grad(params, x, w))
r1 = resource.getrusage(resource.RUSAGE_SELF); wall = time.perf_counter() - t
print("per call: wall", wall / 10 * 1e3, "ms; minflt", (r1.ru_minflt - r0.ru_minflt) / 10, "; user", (r1.ru_utime - r0.ru_utime) / 10 * 1e3, "ms; sys", (r1.ru_stime - r0.ru_stime) / 10 * 1e3, "ms; nvcsw", (r1.ru_nvcsw-r0.ru_nvcsw)/10, "nivcsw", (r1.ru_nivcsw-r0.ru_nivcsw)/10)
