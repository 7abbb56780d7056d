"""Sharded train steps on 8 simulated CPU devices equal the single-device step: every registered
method (at its first contract case; transformer_vq and dense also in GAU blocks) on the meshes (data, fsdp, tensor, sequence) of the scale-out
issue, parameters really sharded, the Pallas kernels (interpret mode) each run per shard in a shard_map, and the
plan's errors."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import xla_flags

SCRIPT = textwrap.dedent(
    """
    import sys, jax, numpy as np, ml_collections
    from longctx import attention
    from longctx.config import base_config, validate
    from longctx.models.decoder import build_model
    from longctx.train import sequence_parallel, sharding
    from longctx.train.optim import make_optimizer
    from longctx.train.step import make_train_step, split_model

    assert jax.device_count() == 8, jax.devices()

    def shard_maps(jaxpr):
        # shard_map calls in a step's jaxpr, nested ones included
        from jax._src.core import jaxprs_in_params
        return sum((e.primitive.name == "shard_map") + sum(shard_maps(getattr(j, "jaxpr", j))
                                                           for j in jaxprs_in_params(e.params)) for e in jaxpr.eqns)
    methods = sys.argv[1].split(",")
    # "2x1x1x4" (mesh.sequence_mode auto) or "2x1x1x4:compose"
    meshes = [(tuple(int(x) for x in m.partition(":")[0].split("x")), m.partition(":")[2] or "auto")
              for m in sys.argv[2].split(",")]
    seq_len, window = (int(x) for x in sys.argv[3].split("/"))  # two windows carry the state
    tokens = np.random.default_rng(0).integers(0, 64, (8, seq_len + 1)).astype(np.int32)
    for spec in methods:
        spec_name, _, impl = spec.partition("=")  # name=pallas: execution.attention.<name>.impl
        method, _, block = spec_name.partition("@")  # name@gau: the method inside GAU blocks
        case = next(iter(attention.get_class(method).contract_cases().values()))
        c = base_config()
        if block:
            c.model.block = block
        if impl:
            c.execution.attention[method].impl = impl
        c.model.vocab_size = 64
        c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
        c.model.positions = "none"
        c.model.attention.name = method
        exec_keys = attention.execution_keys(method)
        c.model.attention[method] = {k: v for k, v in case.cfg.items() if k not in exec_keys}
        for k, v in case.cfg.items():  # the case's execution settings go to their section (impl= here wins)
            if k in exec_keys and not (impl and k == "impl"):
                c.execution.attention[method][k] = v
        if c.model.attention[method].get("max_len", seq_len) < seq_len:  # levels sized for the row (fma)
            c.model.attention[method].max_len = seq_len
        c.train.seq_len, c.train.window, c.train.batch_size, c.train.steps, c.train.warmup_steps = seq_len, window, 8, 10, 1
        c.model.dropout = 0.0
        cfg = validate(c)
        results = []
        for shape, seq_mode in [((1, 1, 1, 1), "auto")] + meshes:
            n = int(np.prod(shape))
            mc = ml_collections.ConfigDict(dict(zip(sharding.AXES, shape)))
            mesh = sharding.make_mesh(mc, jax.devices()[:n])
            model = build_model(cfg.model, seed=0, execution=cfg.execution)
            # the trainer's choice: composed states over 'sequence' where the cores compose, else XLA
            mode, hidden = sequence_parallel.train_hidden(model, mesh, window=window, seq_len=seq_len, mode=seq_mode,
                                                          fold_key=False)
            graphdef, params, nongrad, rest = split_model(model)
            tx = make_optimizer(cfg.train)
            opt = tx.init(params)
            plan = sharding.Plan(mesh, params, nongrad, rest, tx, opt)
            params, nongrad, rest, opt = plan.put(params, nongrad, rest, opt)
            if shape[1] * shape[2] > 1:
                assert any(sharding.is_sharded(x) for x in jax.tree.leaves(params)), (spec, shape, "nothing sharded")
            step = plan.jit_step(make_train_step(graphdef, tx, seq_len=seq_len, window=window, skip_nonfinite=False,
                                                 constrain=plan.constrain, hidden=hidden), donate=False)
            batch = sharding.shard_batch(mesh, tokens)
            if impl == "pallas":  # the kernels run per shard (a shard_map) where the mesh splits rows or heads
                count = shard_maps(jax.make_jaxpr(step)(params, nongrad, rest, opt, batch, jax.random.key(0)).jaxpr)
                assert (count > 0) == (n > 1), (spec, shape, count)
                print("SHARD_MAPS", spec, shape, count)
            p, ng, o, m = step(params, nongrad, rest, opt, batch, jax.random.key(0))
            results.append((shape, jax.device_get(p), jax.device_get(ng), jax.device_get(m["loss"])))
            if shape[3] > 1:
                print("MODE", spec, shape, mode)
        _, p1, n1, l1 = results[0]
        for shape, p, ng, l in results[1:]:
            np.testing.assert_allclose(l, l1, rtol=2e-5, err_msg=f"{spec} {shape} loss")
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p1)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=f"{spec} {shape} params")
            for a, b in zip(jax.tree.leaves(ng), jax.tree.leaves(n1)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=f"{spec} {shape} non-grad state")
        print("OK", spec, l1)
    """
)

MESHES = "8x1x1x1,2x2x2x1,1x4x2x1,2x1x1x4"


def _env() -> dict:
    """The suite's XLA flags and 8 simulated devices, the checkout importable."""
    return {**os.environ, "XLA_FLAGS": xla_flags(8),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _run(methods, meshes, lengths="32/16"):
    env = _env()
    r = subprocess.run([sys.executable, "-c", SCRIPT, methods, meshes, lengths], capture_output=True, text=True,
                       timeout=1800, env=env)
    assert r.returncode == 0 and r.stdout.count("OK") == len(methods.split(",")), r.stderr[-4000:]
    return r.stdout


def test_sharded_steps_equal_single_device_fast():
    """Default run: exact attention on an fsdp x tensor mesh and a sequence mesh (every method on every
    mesh runs under -m slow); the sequence mesh runs the composed-state path, two windows carrying state."""
    out = _run("dense", "2x2x2x1,2x1x1x4,2x1x1x4:compose")
    assert "MODE dense (2, 1, 1, 4) xla" in out, out  # auto: the partitioner's split for exact attention
    assert "MODE dense (2, 1, 1, 4) compose" in out, out


KERNEL_SPECS = "transformer_vq=pallas,eva=pallas,fma=pallas"  # method=impl: execution.attention.<method>.impl


@pytest.mark.slow  # three kernels in interpret mode under 8 devices: the heaviest compile of the file
def test_pallas_kernels_run_per_shard_and_equal_single_device():
    """impl='pallas' (interpret mode) for the methods with Pallas kernels on a data x fsdp x tensor mesh, one
    window per row (full passes, where every kernel serves): each kernel call runs in a shard_map over the rows and
    heads (none on one device) and the step equals the single-device step."""
    out = _run(KERNEL_SPECS, "2x2x2x1", lengths="32/32")
    for spec in KERNEL_SPECS.split(","):
        assert f"SHARD_MAPS {spec} (1, 1, 1, 1) 0" in out, out
        assert f"SHARD_MAPS {spec} (2, 2, 2, 1)" in out, out


@pytest.mark.slow
def test_pallas_kernels_on_every_mesh_equal_single_device():
    """The kernels on every mesh: one window per row (full passes), and two windows carrying the state for the
    kernels that serve a call after a state (transformer_vq's, also in GAU blocks; EVA's Phase A). FMA's streamed
    calls run the kernel's reference, so a windowed step has no FMA kernel call to place."""
    _run(KERNEL_SPECS + ",transformer_vq@gau=pallas", MESHES, lengths="32/32")
    _run("transformer_vq=pallas,eva=pallas,transformer_vq@gau=pallas", MESHES, lengths="32/16")


@pytest.mark.slow
def test_every_method_on_every_mesh_equals_single_device():
    from longctx import attention

    # every method in transformer blocks, plus GAU blocks (the paper's block of transformer_vq; dense beside it)
    _run(",".join(list(attention.names()) + ["transformer_vq@gau", "dense@gau"]), MESHES)


@pytest.mark.slow
def test_composed_state_steps_equal_single_device():
    """Slices of 16 tokens (rows of 128 in two windows of 64 over sequence = 4): every method whose
    cores compose runs the composed-state train step (transformer_vq's codebook statistics summed
    over the slices), and equals one device."""
    specs = "transformer_vq@gau,transformer_vq,eva,fma,fma_linear"
    out = _run(specs, "2x1x1x4,1x2x1x4", lengths="128/64")
    assert out.count(" compose") == 2 * len(specs.split(",")), out


def test_plan_errors_name_the_dimension():
    from longctx.errors import ConfigError
    from longctx.train import sharding

    with pytest.raises(ConfigError, match="unknown logical axis"):
        sharding.parse_rules("emb=fsdp")
    with pytest.raises(ConfigError, match="unknown mesh axis"):
        sharding.parse_rules("embed=model")
    assert sharding.parse_rules("vocab=,embed=fsdp+tensor")["embed"] == ("fsdp", "tensor")
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1, "sequence": 2}, 8) == (2, 2, 1, 2)
    with pytest.raises(ConfigError, match="available"):
        sharding.mesh_shape({"data": 3, "fsdp": 2, "tensor": 1, "sequence": 1}, 8)


def test_indivisible_dimension_is_a_config_error_naming_it():
    env = _env()
    code = textwrap.dedent("""
        import jax, ml_collections
        from longctx.config import base_config
        from longctx.models.decoder import build_model
        from longctx.train import sequence_parallel, sharding
        from longctx.train.step import split_model
        from longctx.errors import ConfigError
        c = base_config().model
        c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = 64, 30, 1, 2, 16, 64
        g, p, n, r = split_model(build_model(c))
        mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 2, "fsdp": 4, "tensor": 1, "sequence": 1}))
        try:
            sharding.Plan(mesh, p, n, r)
        except ConfigError as e:
            print("ERR", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "ERR" in r.stdout and "'embed' of size 30" in r.stdout and "fsdp" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_mesh_or_batch_the_devices_cannot_take_is_refused_before_any_work(tmp_path):
    """``sharding.check_layout`` (longctx-train runs it before the data is prepared or the workdir made, and
    ``--check`` too): a batch the batch-parallel devices do not divide, a mesh of more devices than there are."""
    from longctx.config import base_config, validate
    from longctx.errors import ConfigError
    from longctx.train import sharding
    from longctx.train.loop import train

    c = base_config()
    c.train.batch_size, c.mesh.data = 4, 8
    cfg = validate(c)
    with pytest.raises(ConfigError, match=r"batch_size=4 must be a multiple of the 8 batch-parallel devices "
                                          r"\(mesh.data=8 x mesh.fsdp=1 of 8 devices\)"):
        sharding.check_layout(cfg, 8)
    with pytest.raises(ConfigError, match=r"batch_size=4 must be a multiple of the 8 batch-parallel devices"):
        sharding.check_layout(cfg, 1, here=False)  # --check of a config for an 8-device machine, here on one
    cfg.train.batch_size = 16
    sharding.check_layout(cfg, 8)
    sharding.check_layout(cfg, 1, here=False)
    with pytest.raises(ConfigError, match=r"uses 8 devices; 1 are available"):
        train(c, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
