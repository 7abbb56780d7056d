"""Sequence parallelism: forward and gradient of a 4,096-token row split over 4 and 8 simulated
devices equal the single-device result (transformer block with every causal method; GAU block with
transformer_vq), by composed states where the cores declare them, else by the ring."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp, numpy as np, ml_collections
    from flax import nnx
    from longctx import attention
    from longctx.config import base_config
    from longctx.models.decoder import build_model
    from longctx.train import sharding, sequence_parallel as sp

    T = int(sys.argv[2])
    for spec in sys.argv[1].split(","):
        method, block = spec.split(":")
        case = next(iter(attention.get_class(method).contract_cases().values()))
        c = base_config().model
        c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 64, 16, 2, 2, 8, 32
        c.block, c.positions = block, "none"
        c.attention.name = method
        c.attention[method] = dict(case.cfg)
        if c.attention[method].get("max_len", T) < T:  # a contract case sized for short rows (fma's levels)
            c.attention[method].max_len = T
        model = build_model(c, seed=0)
        graphdef, variables = nnx.split(model)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, T)), jnp.int32)
        w = jax.random.normal(jax.random.key(1), (1, T, c.d_model))

        def loss_single(v):
            h, _, _ = nnx.merge(graphdef, v).hidden(tokens, None)
            return jnp.sum(h * w), h

        (l1, h1), g1 = jax.jit(jax.value_and_grad(loss_single, has_aux=True))(variables)
        for D in (int(x) for x in sys.argv[3].split(",")):
            mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1, "sequence": D}),
                                      jax.devices()[:D])

            for mode in sys.argv[4].split(","):
                used, reasons = sp.plan(model, T // D, mode)
                print("MODE", spec, D, used, reasons)
                if mode == "auto" and method in sys.argv[5].split(","):
                    assert used == "compose", (spec, D, mode, reasons)

                def loss_sp(v):
                    h = sp.hidden(graphdef, v, tokens, mesh, mode=mode)
                    return jnp.sum(h * w), h

                (lD, hD), gD = jax.jit(jax.value_and_grad(loss_sp, has_aux=True))(variables)
                np.testing.assert_allclose(np.asarray(hD), np.asarray(h1), atol=2e-4, rtol=2e-4,
                                           err_msg=f"{spec} D={D} {used}")
                for a, b in zip(jax.tree.leaves(gD), jax.tree.leaves(g1)):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3, rtol=2e-3,
                                               err_msg=f"{spec} D={D} {used} grad")
        print("OK", spec)
    """
)


# the methods whose carried states compose (the prefix scan over devices, not the ring)
COMPOSING = "dense,transformer_vq,eva,fma,fma_linear"


def _run(specs, T, devices="4,8", modes="auto"):
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", SCRIPT, specs, str(T), devices, modes, COMPOSING], capture_output=True,
                       text=True, timeout=3000, env=env)
    assert r.returncode == 0 and r.stdout.count("OK") == len(specs.split(",")), r.stdout + r.stderr[-4000:]
    return r.stdout


def test_sequence_parallel_equals_single_device_short_row():
    out = _run("dense:transformer,transformer_vq:gau", 256, devices="4")
    assert out.count(" compose ") == 2, out  # the ring runs for the cores that refuse, in the slow test


def test_compose_mode_refusal_names_the_core_and_the_reason():
    from longctx.config import base_config
    from longctx.models.decoder import build_model
    from longctx.train import sequence_parallel as sp

    c = base_config().model
    c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 64, 16, 1, 2, 8, 32
    c.attention.name = "eva"
    model = build_model(c, seed=0)
    chunk = model.blocks[0].core.cfg.chunk_size
    assert sp.plan(model, 4 * chunk) == ("compose", [])
    mode, reasons = sp.plan(model, 4 * chunk + 1)
    assert mode == "ring" and reasons and "chunk_size" in reasons[0], reasons
    with pytest.raises(ValueError, match="eva: a slice of .* not a multiple of chunk_size"):
        sp.plan(model, 4 * chunk + 1, "compose")
    with pytest.raises(ValueError, match="allowed: auto, compose, ring"):
        sp.plan(model, 4 * chunk, "scan")


@pytest.mark.slow
def test_sequence_parallel_4096_tokens_every_causal_method():
    from longctx import attention

    specs = [f"{m}:transformer" for m in attention.names() if attention.get_class(m).supports_causal]
    _run(",".join(specs + ["transformer_vq:gau"]), 4096)


def test_train_plan_modes_and_the_compose_refusal():
    import types

    from longctx.config import base_config
    from longctx.errors import ConfigError
    from longctx.models.decoder import build_model
    from longctx.train import sequence_parallel as sp

    mesh = types.SimpleNamespace(shape={"sequence": 4})  # train_plan reads the axis size only
    c = base_config().model
    c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 64, 16, 1, 2, 8, 32
    for name, mode in (("eva", "compose"), ("dense", "xla")):  # dense: the partitioner's split is better
        c.attention.name = name
        assert sp.train_plan(build_model(c), mesh, 64) == mode, name
    c.attention.name = "eva"
    model = build_model(c)
    assert sp.train_plan(model, mesh, 64, "xla") == "xla"
    assert sp.train_plan(model, types.SimpleNamespace(shape={"sequence": 1}), 64, "compose") == "xla"
    with pytest.raises(ConfigError, match="sequence_mode='compose' cannot run: eva: a slice of 17 tokens"):
        sp.train_plan(model, mesh, (64, 68), "compose")
    c.attention.name, c.causal = "kdeformer", False
    with pytest.raises(ConfigError, match="kdeformer: bidirectional attention carries no state"):
        sp.train_plan(build_model(c), mesh, 64, "compose")
    c.causal = True
    with pytest.raises(ConfigError, match="kdeformer: .*declares no composition"):
        sp.train_plan(build_model(c), mesh, 64, "compose")
