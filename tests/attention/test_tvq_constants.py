"""Transformer-VQ's calls give XLA no large all-constant softmax group to fold: a causal call without a carried
state (its empty band and cache) and a bidirectional one of at most two blocks (no block two or more away: empty code
summaries) once built all-masked groups from constants (zeros, not iotas), whose row maxima over [B, H, R, L, S] (or
L) XLA:CPU evaluated at compile time: seconds at the default L = S = 512, printed as ``slow_operation_alarm ...
Constant folding an instruction is taking > 1s``. The empty state and summaries now pass an optimization barrier;
the values are unchanged (tests/attention/test_transformer_vq.py).

Checked on the jaxpr: no select on a uniform constant predicate and no reduction of a constant operand (computed from
literals alone: XLA does not fold an iota, so masks from positions are no constants here) of at least 4096
elements."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from longctx.bench import common as C
from longctx.bench.cores import CoreFns, build_core

REDUCTIONS = ("reduce_max", "reduce_min", "reduce_sum")


def constant_work(jaxpr, const_in=None, at_least: int = 4096) -> list[str]:
    """The selects whose predicate is a uniform constant and the reductions of a constant operand, over at least
    ``at_least`` elements, in ``jaxpr`` and its sub-jaxprs: XLA folds them (a constant is computed from literals
    only; an iota, an argument or an optimization barrier ends one). ``const_in``: the constant inputs' values."""
    const = dict(const_in or {})
    const.update({v: None for v in jaxpr.constvars})
    found = []

    def is_const(x):
        return isinstance(x, jcore.Literal) or x in const

    def value(x):
        return x.val if isinstance(x, jcore.Literal) else const[x]

    for e in jaxpr.eqns:
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    j = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                    inner = ({a: value(b) for a, b in zip(j.invars, e.invars) if is_const(b)}
                             if len(j.invars) == len(e.invars) else {})
                    found += constant_work(j, inner, at_least)
        name, first = e.primitive.name, e.invars[0] if e.invars else None
        if first is not None and is_const(first) and math.prod(first.aval.shape) >= at_least:
            if name in REDUCTIONS:
                found.append(f"{name} of {first.aval}")
            elif name == "select_n" and value(first) is not None and np.unique(np.asarray(value(first))).size == 1:
                found.append(f"select_n on the uniform {first.aval}")
        if name not in ("iota", "optimization_barrier") and all(is_const(x) for x in e.invars):
            try:
                vals = [value(x) for x in e.invars]
                out = e.primitive.bind(*vals, **e.params) if all(v is not None for v in vals) else None
            except Exception:  # noqa: BLE001 -- a primitive that will not run outside its trace: value unknown
                out = None
            outs = out if e.primitive.multiple_results and out is not None else [out] * len(e.outvars)
            const.update({o: (None if out is None else x) for o, x in zip(e.outvars, outs)})
    return found


@pytest.mark.parametrize("causal,T", [(True, 512), (True, 300), (True, 1024), (False, 1024), (False, 512)])
def test_transformer_vq_gives_xla_no_constant_softmax_group(causal, T):
    core = build_core("transformer_vq", None, heads=1, head_dim=16, causal=causal, seed=0)  # L = S = 512
    assert core.L == 512 and core.S == 512
    fns = CoreFns(core)
    q, k, v = C.random_qkv(0, 1, 1, T, 16)
    assert constant_work(jax.make_jaxpr(fns.forward())(fns.params, fns.rest, q, k, v).jaxpr) == []
    w = C.random_qkv(1, 1, 1, T, 16)[2]
    assert constant_work(jax.make_jaxpr(fns.grads())(fns.params, fns.rest, q, k, v, w, jax.random.key(0)).jaxpr) == []


def test_constant_work_tells_literals_from_iotas():
    x = jnp.ones((64, 64))
    assert constant_work(jax.make_jaxpr(lambda a: jnp.where(jnp.zeros((64, 64)) > 0, a, 0.0))(x).jaxpr) == [
        "select_n on the uniform bool[64,64]"]
    assert constant_work(jax.make_jaxpr(lambda a: jnp.where(jnp.arange(64)[:, None] >= jnp.arange(64), a, 0.0))(x).jaxpr) == []
    barred = jax.make_jaxpr(lambda a: jnp.max(jax.lax.optimization_barrier(jnp.zeros((64, 64))) + 1.0))(x)
    assert constant_work(barred.jaxpr) == []
    assert constant_work(jax.make_jaxpr(lambda a: jnp.max(jnp.zeros((64, 64)) + 1.0) + a)(x).jaxpr) == [
        "reduce_max of float32[64,64]"]


def test_the_encoder_of_two_blocks_equals_the_reference():
    """Two blocks of 512 (every key in the band): the encoder form runs the band alone (an all-masked summary
    group there came out of XLA:CPU's jit as NaN at batch 2, 4 heads of 64); it equals the reference."""
    import jax.numpy as jnp

    from tests.attention import kit

    q, k, v = kit.qkv(1024, batch=2, heads=4, head_dim=64)
    want = kit.out(kit.build("transformer_vq", False, heads=4, head_dim=64, impl="reference"), q, k, v)
    got = kit.out(kit.build("transformer_vq", False, heads=4, head_dim=64, impl="encoder"), q, k, v)
    assert not bool(jnp.any(jnp.isnan(got))) and kit.maxdiff(got, want) < 1e-4
