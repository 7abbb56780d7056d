"""On Hopper, ``impl='auto'`` takes no Triton kernel (JAX deprecated its Pallas Triton backend): each method with
a Mosaic GPU implementation takes it, the Triton kernels step aside (``dispatch.hopper``), and the layer's forward
and gradient export for cuda with the Triton backend removed from JAX altogether (an import hook refuses
``jax.experimental.pallas.triton`` and ``jax._src.pallas.triton``: the next JAX, simulated). Before Hopper
(compute capability 8.0) 'auto' still takes the Triton kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# method -> (settings, tokens, what 'auto' takes on Hopper for a bf16 full pass); heads of 64 (the wgmma kernels'
# widths), the smallest shapes each Mosaic GPU kernel serves
CASES = {
    "eva": ({"window_size": 128, "chunk_size": 8}, 512, "mosaic_gpu"),
    "fma": ({"m": 64, "p": 4, "max_len": 512}, 512, "mosaic_gpu"),
    "transformer_vq": ({"block_len": 64, "codebook_size": 64}, 256, "mosaic_gpu"),
    "kdeformer": ({"heavy_scores_max_len": 64}, 512, "mosaic_gpu"),  # a full pass whose heavy route is 'band'
    "fma_linear": ({"m": 64, "p": 4, "max_len": 512}, 512, "xla"),  # no kernel computes FMA-linear's statistics
}

SCRIPT = r"""
import importlib.abc, json, sys, warnings

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith(("jax.experimental.pallas.triton", "jax._src.pallas.triton")):
            raise ImportError(f"{name}: no Triton backend in this JAX (simulated)")
        return None

sys.meta_path.insert(0, NoTriton())
import jax, jax.numpy as jnp
from flax import nnx
from longctx import attention
from longctx.attention import dispatch

chosen = []
select = dispatch.select
def recording(impl, implementations, *, method, platform, **shapes):
    choice = select(impl, implementations, method=method, platform=platform, **shapes)
    chosen.append(choice.name)
    return choice
dispatch.select = recording

out = {}
for cc, name, cfg, T in json.loads(sys.argv[1]):
    dispatch.cuda_compute_capability = lambda: cc
    chosen.clear()
    core = attention.build(name, cfg, num_heads=2, head_dim=64, causal=True, rngs=nnx.Rngs(0), platform="cuda")
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, T, 64), jnp.bfloat16) for i in range(3))

    def loss(q, k, v):
        return jnp.sum(core(q, k, v)[0].astype(jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                                 platforms=["cuda"])(q, k, v).mlir_module()
    out[f"{cc} {name}"] = {"chosen": sorted(set(chosen)), "triton": text.count("xla.gpu.triton"),
                 "mosaic_gpu": text.count("@mosaic_gpu"),
                 "imported": sorted(m for m in sys.modules if "pallas.triton" in m)}
print("RESULT " + json.dumps(out))
"""


# before Hopper, on a JAX without the Triton backend: each Triton kernel refuses (``lazy_triton.missing``) and
# 'auto' goes on to XLA (Transformer-VQ: its block-parallel form)
WITHOUT_TRITON = {"eva": "xla", "fma": "xla", "transformer_vq": "parallel", "kdeformer": "xla"}


def test_hopper_auto_path_runs_without_the_triton_backend():
    """Every case's forward+gradient exported for cuda in a process whose JAX has no Triton backend: on Hopper
    'auto' takes the Mosaic GPU implementations (FMA-linear: XLA), their kernels in the program; before Hopper the
    Triton kernels refuse and 'auto' takes XLA; no Triton call, no Triton module imported (the kernel modules read
    it lazily: ``pallas_kernels.lazy_triton``)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    runs = [("9.0", name, cfg, T) for name, (cfg, T, _) in CASES.items()]
    runs += [("8.0", name, CASES[name][0], CASES[name][1]) for name in WITHOUT_TRITON]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    want = {f"9.0 {name}": case[2] for name, case in CASES.items()}
    want.update({f"8.0 {name}": impl for name, impl in WITHOUT_TRITON.items()})
    for key, impl in want.items():
        row = got[key]
        assert row["chosen"] == [impl], (key, row)
        assert row["triton"] == 0 and row["imported"] == [], (key, row)
        assert (row["mosaic_gpu"] >= 2) == (impl == "mosaic_gpu"), (key, row)  # forward and backward kernels


@pytest.mark.parametrize("cc,want", [("9.0", "mosaic_gpu"), (None, "mosaic_gpu"), ("8.0", "pallas"),
                                     ("10.0", "pallas")])
def test_auto_on_cuda_by_compute_capability(monkeypatch, cc, want):
    """Hopper (or a cuda export from a host without a GPU) takes the Mosaic GPU kernels; Ampere and Blackwell
    (where wgmma does not run) the Triton ones; float32 inputs on Hopper leave the kernels (wgmma would round them
    to tf32) for XLA."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: cc)
    assert dispatch.hopper("cuda") == (want == "mosaic_gpu") and not dispatch.hopper("tpu")
    for name in ("eva", "fma", "transformer_vq", "kdeformer"):
        cfg, T, _ = CASES[name]
        core = attention.build(name, cfg, num_heads=2, head_dim=64, causal=True, rngs=nnx.Rngs(0),
                               platform="cuda")
        q = jnp.zeros((1, 2, T, 64), jnp.bfloat16)
        _, shapes = core.prepare(q, q, q, None, deterministic=True, key=None)
        assert core.select(**shapes).name == want, name
        if want == "mosaic_gpu":
            _, shapes = core.prepare(*(q.astype(jnp.float32),) * 3, None, deterministic=True, key=None)
            assert core.select(**shapes).name not in ("mosaic_gpu", "pallas"), name


def _on_hopper() -> bool:
    return dispatch.current_platform() == "cuda" and dispatch.hopper("cuda")


@pytest.mark.skipif(not _on_hopper(), reason="compiles the Mosaic GPU kernels: a Hopper GPU (gpu_check.sh)")
@pytest.mark.parametrize("name", ["eva", "fma", "transformer_vq", "kdeformer"])
def test_hopper_compiled_auto_equals_xla(name):
    """On a Hopper GPU: the layer as 'auto' runs it (the Mosaic GPU kernels, compiled) against the same layer on
    its XLA path, outputs and gradients of q, k, v in bfloat16."""
    cfg, T, want = CASES[name]
    xla = {"impl": "blocks", "reduction": "serial"} if name == "transformer_vq" else {"impl": "xla"}
    cores = {impl: attention.build(name, {**cfg, **extra}, num_heads=2, head_dim=64, causal=True, rngs=nnx.Rngs(0))
             for impl, extra in (("auto", {}), ("xla", xla))}
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 2, T, 64), jnp.bfloat16) for i in range(3))
    w = jax.random.normal(jax.random.PRNGKey(9), (2, 2, T, 64), jnp.float32)
    got = {}
    for impl, core in cores.items():
        q0 = jnp.zeros_like(q)
        _, shapes = core.prepare(q0, q0, q0, None, deterministic=True, key=None)
        if impl == "auto":
            assert core.select(**shapes).name == want
        got[impl] = jax.jit(jax.value_and_grad(
            lambda q, k, v, c=core: jnp.sum(c(q, k, v)[0].astype(jnp.float32) * w), argnums=(0, 1, 2)))(q, k, v)
    (la, ga), (lx, gx) = got.values()
    scale = float(jnp.sum(jnp.abs(w)))
    assert abs(float(la) - float(lx)) < 2e-2 * scale / (T ** 0.5)
    for a, b in zip(ga, gx):
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        assert err < 5e-2 * (1.0 + float(jnp.max(jnp.abs(b.astype(jnp.float32))))), (name, err)
