"""Transformer-VQ's tiled causal form (``impl='blocks'``, and the XLA:CPU implementation's) in a narrow compute
dtype: its forward and its hand-written backward take compute-dtype (bfloat16) matmul operands with float32
accumulation, as the one-shot form does under autodiff; float32 inputs keep every product in float32."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from longctx.attention.transformer_vq import xla, xla_cpu
from longctx.attention.transformer_vq.state import empty_state

_DOT = re.compile(r"stablehlo\.dot_general\s+%[\w#]+,\s*%[\w#]+,\s*(.*?)\s*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")
_DIMS = re.compile(r"contracting_dims\s*=\s*\[([\d, ]*)\]\s*x\s*\[([\d, ]*)\]")
_BATCH = re.compile(r"batching_dims\s*=\s*\[([\d, ]*)\]\s*x\s*\[([\d, ]*)\]")


def _tensor(t: str):
    *dims, dtype = t[len("tensor<"):-1].split("x")
    return tuple(int(d) for d in dims), dtype


def dot_flops(text: str):
    """[(flops, lhs dtype, rhs dtype)] of every ``dot_general`` of a StableHLO module."""
    out = []
    for m in _DOT.finditer(text):
        (ls, lt), (rs, rt) = _tensor(m.group(2)), _tensor(m.group(3))
        ints = lambda s: [int(v) for v in s.split(",") if v.strip()]  # noqa: E731
        c, b = _DIMS.search(m.group(1)), _BATCH.search(m.group(1))
        skip = set((ints(c.group(2)) if c else []) + (ints(b.group(2)) if b else []))
        out.append((2 * math.prod(ls) * math.prod(d for i, d in enumerate(rs) if i not in skip), lt, rt))
    return out


def lowered_value_and_grad(fn, dtype, keep_budget):
    B, H, T, Dk, Dv, S, L, M = 2, 2, 64, 16, 32, 16, 16, 16
    ks = jax.random.split(jax.random.key(0), 7)
    q_u, q_v, k_hat = (jax.random.normal(k, (B, H, T, Dk), dtype) for k in ks[:3])
    r = jax.random.normal(ks[3], (M + 1, H, Dk), dtype)
    v = jax.random.normal(ks[4], (B, H, T, Dv), dtype)
    z = jax.random.randint(ks[5], (B, H, T), 0, S)
    C = jax.random.normal(ks[6], (H, S, Dk), jnp.float32)
    state = empty_state(B, H, M, S, Dk, Dv)

    def loss(q_u, q_v, r, k_hat, v):
        o, new = fn(q_u, q_v, r, k_hat, z, v, C, state, L=L, M=M, q_tile=8, keep_budget=keep_budget)
        assert new["agg_mu"].dtype == jnp.float32  # the carried state stays in the statistics dtype
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q_u, q_v, r, k_hat, v).as_text()


@pytest.mark.parametrize("keep_budget", [0, 1 << 30], ids=["recompute", "keep"])
@pytest.mark.parametrize("products", ["plain", "xla_cpu"])
def test_tiled_form_products_take_the_compute_dtype(products, keep_budget):
    fn = xla.causal_blocks if products == "plain" else xla_cpu.causal_blocks
    bf16 = dot_flops(lowered_value_and_grad(fn, jnp.bfloat16, keep_budget))
    wide = [d for d in bf16 if not d[1] == d[2] == "bf16"]
    # float32 by design, statistics: the plain products' per-code sums (two one-hot dots, the cache's and the new
    # state's; scatter-adds with the XLA:CPU products), the XLA:CPU backward's row dot of do and o (the softmax
    # gradient's delta; a multiply-and-reduce with the plain products). Every attention product, forward and
    # backward, takes bfloat16 operands
    assert len(bf16) > 10 and len(wide) <= (2 if products == "plain" else 1), wide
    fp32 = dot_flops(lowered_value_and_grad(fn, jnp.float32, keep_budget))
    assert fp32 and all(a == b == "f32" for _, a, b in fp32)
