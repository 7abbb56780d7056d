"""Synthetic EVA chunk part at 8k: 8 groups of 1024 queries, group g sees nc=128(g+1) chunks, causal staircase mask."""
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import time, numpy as np, jax, jax.numpy as jnp, sys
H=jax.lax.Precision.HIGHEST; NEG=-1e30
def tm(f, n=15):
    f(); f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return np.median(ts)*1e3
B,Hh,T,d,P=1,4,8192,64,8; C=T//P; G=8; Q=T//G
rng=np.random.default_rng(0)
q=jnp.asarray(rng.standard_normal((B,Hh,T,d)).astype(np.float32))
kh=jnp.asarray(rng.standard_normal((B,Hh,C,d)).astype(np.float32))
be=jnp.asarray(rng.standard_normal((B,Hh,C,d)).astype(np.float32))
do=jnp.asarray(rng.standard_normal((B,Hh,T,d)).astype(np.float32))
s=d**-0.5
def mask(g, nc):
    n=np.arange(g*Q,(g+1)*Q)[:,None]; c=np.arange(nc)[None]
    return jnp.asarray((c+1)*P<=n)
def group_fb(q, kh, be, do, g, variant):
    nc=128*(g+1); m_=mask(g,nc)
    k=kh[:,:,:nc]; b=be[:,:,:nc]
    a=s*jnp.einsum("bhqd,bhcd->bhqc",q,k,precision=H)
    a=jnp.where(m_,a,NEG)
    m=jnp.max(a,-1,keepdims=True)
    p=jnp.where(m_,jnp.exp(a-m),0.)
    if variant=="ones":
        b1=jnp.concatenate([b,jnp.ones(b.shape[:-1]+(1,),b.dtype)],-1)
        nd=jnp.einsum("bhqc,bhcd->bhqd",p,b1,precision=H); num,den=nd[...,:-1],nd[...,-1]
    else:
        den=jnp.sum(p,-1); num=jnp.einsum("bhqc,bhcd->bhqd",p,b,precision=H)
    w=1/den
    out=num*w[...,None]
    delta=jnp.einsum("bhqd,bhqd->bhq",do,out)[...,None]
    dp=jnp.einsum("bhqd,bhcd->bhqc",do,b,precision=H)
    ds=p*w[...,None]*(dp-delta)
    dq=s*jnp.einsum("bhqc,bhcd->bhqd",ds,k,precision=H)
    if variant=="qT":
        qT=jax.lax.optimization_barrier(jnp.swapaxes(q,-1,-2)); dwT=jax.lax.optimization_barrier(jnp.swapaxes(do*w[...,None],-1,-2))
        dk=s*jax.lax.optimization_barrier(jnp.einsum("bhdq,bhqc->bhdc",qT,ds,precision=H))
        db=jax.lax.optimization_barrier(jnp.einsum("bhdq,bhqc->bhdc",dwT,p,precision=H))
        dk=jnp.swapaxes(dk,-1,-2); db=jnp.swapaxes(db,-1,-2)
    elif variant=="qTnb":
        qT=jax.lax.optimization_barrier(jnp.swapaxes(q,-1,-2)); dwT=jax.lax.optimization_barrier(jnp.swapaxes(do*w[...,None],-1,-2))
        dk=s*jnp.einsum("bhdq,bhqc->bhdc",qT,ds,precision=H)
        db=jnp.einsum("bhdq,bhqc->bhdc",dwT,p,precision=H)
        dk=jnp.swapaxes(dk,-1,-2); db=jnp.swapaxes(db,-1,-2)
    elif variant=="dc":
        dk=jnp.swapaxes(s*jnp.einsum("bhqd,bhqc->bhdc",q,ds,precision=H),-1,-2)
        db=jnp.swapaxes(jnp.einsum("bhqd,bhqc->bhdc",do*w[...,None],p,precision=H),-1,-2)
    else:
        dk=s*jnp.einsum("bhqc,bhqd->bhcd",ds,q,precision=H)
        db=jnp.einsum("bhqc,bhqd->bhcd",p,do*w[...,None],precision=H)
    return out,dq,dk,db
def full(variant):
    def f(q,kh,be,do):
        outs=[]; dks=0; dbs=0
        for g in range(G):
            o,dq,dk,db=group_fb(q[:,:,g*Q:(g+1)*Q],kh,be,do[:,:,g*Q:(g+1)*Q],g,variant)
            outs.append(o+dq); nc=dk.shape[2]
            dks=dks+jnp.pad(dk,((0,0),(0,0),(0,C-nc),(0,0))); dbs=dbs+jnp.pad(db,((0,0),(0,0),(0,C-nc),(0,0)))
        return jnp.concatenate(outs,2), dks, dbs
    return jax.jit(f)
def mm_only():
    def f(q,kh,be,do):
        outs=[]; dks=0
        for g in range(G):
            nc=128*(g+1); k=kh[:,:,:nc]; b=be[:,:,:nc]; qq=q[:,:,g*Q:(g+1)*Q]; dd=do[:,:,g*Q:(g+1)*Q]
            a=jnp.einsum("bhqd,bhcd->bhqc",qq,k,precision=H)
            o=jnp.einsum("bhqc,bhcd->bhqd",a,b,precision=H)
            dp=jnp.einsum("bhqd,bhcd->bhqc",dd,b,precision=H)
            dq=jnp.einsum("bhqc,bhcd->bhqd",dp,k,precision=H)
            dk=jnp.einsum("bhqc,bhqd->bhcd",dp,qq,precision=H)
            db=jnp.einsum("bhqc,bhqd->bhcd",a,dd,precision=H)
            outs.append(o+dq); dks=dks+jnp.pad(dk+db,((0,0),(0,0),(0,C-nc),(0,0)))
        return jnp.concatenate(outs,2), dks
    return jax.jit(f)
fl=sum(6*2*Hh*Q*128*(g+1)*d for g in range(G))/1e9
for name,f in [("matmuls only",mm_only()),("current-like",full("plain")),("dc",full("dc")),("qTnb",full("qTnb")),("dc",full("dc")),("qTnb",full("qTnb"))]:
    t=tm(lambda: jax.block_until_ready(f(q,kh,be,do)))
    print(f"{name}: {t:.1f} ms  ({fl:.1f} GFLOP -> {fl/t*1e3:.0f} GF/s)")
