import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import time, numpy as np, jax, jax.numpy as jnp, torch
H=jax.lax.Precision.HIGHEST
def tm(f, n=30):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
Q,N,d=1024,1024,64
r=np.random.default_rng(0)
A=r.standard_normal((4,Q,d)).astype(np.float32); Bm=r.standard_normal((4,N,d)).astype(np.float32); S=r.standard_normal((4,Q,N)).astype(np.float32)
Aj,Bj,Sj=map(jnp.asarray,(A,Bm,S)); At,Bt,St=map(torch.from_numpy,(A,Bm,S))
fl=2*4*Q*N*d/1e9
cases=[("qd,cd->qc (logits)", lambda A,B,S: jnp.einsum("bqd,bcd->bqc",A,B,precision=H), lambda: torch.bmm(At,Bt.transpose(1,2))),
       ("qc,cd->qd (p.v)", lambda A,B,S: jnp.einsum("bqc,bcd->bqd",S,B,precision=H), lambda: torch.bmm(St,Bt)),
       ("qc,qd->cd (dk)", lambda A,B,S: jnp.einsum("bqc,bqd->bcd",S,A,precision=H), lambda: torch.bmm(St.transpose(1,2),At)),
       ("qc,qd->dc (dk^T)", lambda A,B,S: jnp.einsum("bqc,bqd->bdc",S,A,precision=H), lambda: torch.bmm(At.transpose(1,2),St)),
       ("cq,qd->cd (keys-major)", lambda A,B,S: jnp.einsum("bcq,bqd->bcd",S,A,precision=H), lambda: torch.bmm(St,At)),
]
for name,fj,ft in cases:
    f=jax.jit(fj); tj=tm(lambda: f(Aj,Bj,Sj).block_until_ready()); tt=tm(ft)
    print(f"{name:28s} jax {tj:.2f} ms {fl/tj*1e3:4.0f} GF/s | torch {tt:.2f} ms {fl/tt*1e3:4.0f} GF/s")
print("---")
def qT_first(A,B,S):
    qT=jnp.swapaxes(A,1,2)
    return jnp.einsum("bdq,bqc->bdc",qT,S,precision=H)
def qT_barrier(A,B,S):
    qT=jax.lax.optimization_barrier(jnp.swapaxes(A,1,2))
    return jnp.einsum("bdq,bqc->bdc",qT,S,precision=H)
def qT_barrier_T(A,B,S):
    qT=jax.lax.optimization_barrier(jnp.swapaxes(A,1,2))
    return jnp.swapaxes(jnp.einsum("bdq,bqc->bdc",qT,S,precision=H),1,2)
def split8(A,B,S):
    return sum(jnp.einsum("bqc,bqd->bdc",S[:,i*128:(i+1)*128],A[:,i*128:(i+1)*128],precision=H) for i in range(8))
for name,fj in [("qT then dq,qc->dc",qT_first),("qT barrier",qT_barrier),("qT barrier + T out",qT_barrier_T),("split8 dc",split8)]:
    f=jax.jit(fj); tj=tm(lambda: f(Aj,Bj,Sj).block_until_ready())
    print(f"{name:28s} jax {tj:.2f} ms {fl/tj*1e3:4.0f} GF/s")
