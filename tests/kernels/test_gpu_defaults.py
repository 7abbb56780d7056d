"""What ``impl='auto'`` runs on an NVIDIA GPU for every flagship launch (the ``:node8`` variants of
scripts/flagship_plans.py): each config's attention core is built abstractly and asked, through its own
``prepare`` and ``select`` (what every call runs), which implementation it takes on ``platform='cuda'`` at the launch's call shapes (the
training window, the core's head dims, bfloat16), on Hopper (compute capability 9.0) and before it (8.0). The
method's Mosaic GPU kernels on Hopper, its Triton kernel before, cuDNN for dense, except where a kernel refuses the
call: those refusals are listed here with the refusing rule's words."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import flagship_plans  # noqa: E402

# the kernel 'auto' should take on a GPU per method and compute capability (the method's own Pallas kernel: Mosaic
# GPU on Hopper, Triton before; cuDNN for exact attention)
KERNEL = {"transformer_vq": "pallas", "eva": "pallas", "fma": "pallas", "dense": "cudnn"}
HOPPER = {**KERNEL, "transformer_vq": "mosaic_gpu", "eva": "mosaic_gpu", "fma": "mosaic_gpu"}

# launches where the GPU kernel refuses the call: name -> (what 'auto' takes instead, the refusal's words)
# (none: WikiText-103's dense heads of 42 dims reach cuDNN zero-padded to 48, its EVA heads of 128 the EVA kernels)
REFUSED: dict[str, tuple[str, str]] = {}

SPECS = sorted(flagship_plans.FLAGSHIP.items())


def _config(spec: str):
    from longctx import config as config_lib

    path, _, variant = spec.partition(":")
    cfg = config_lib.validate(importlib.import_module(path[:-3].replace("/", ".")).get_config(variant))
    if not cfg.model.vocab_size:  # the data's vocabulary; any size builds the same attention cores
        cfg.model.vocab_size = 256
    return cfg


def _cuda_choice(core, cfg):
    """The ``dispatch.Choice`` the core makes for one training call on 'cuda': its own ``prepare`` and ``select``
    (the path of every call, ``AttentionCore.__call__``) traced abstractly on the launch's per-device shapes
    (batch after data sharding, the training window, bfloat16), in training mode (the config's dropout)."""
    import jax

    core.platform = "cuda"  # the core as a GPU run builds it (it selects for the platform it was built for)
    shards = int(cfg.mesh.data) * int(cfg.mesh.fsdp) * int(cfg.train.microbatches)
    B, T = max(1, cfg.train.batch_size // shards), int(cfg.train.window or cfg.train.seq_len)
    q = jax.ShapeDtypeStruct((B, core.num_heads, T, core.head_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, core.num_heads, T, core.value_dim), jnp.bfloat16)
    graphdef, state = nnx.split(core)
    seen = []

    def trace(state, q, k, v):
        c = nnx.merge(graphdef, state)
        _, shapes = c.prepare(q, k, v, None, deterministic=False, key=jax.random.key(0))
        seen.append(c.select(**shapes))
        return 0

    jax.eval_shape(trace, state, q, q, v)
    return seen[-1]


@pytest.mark.parametrize("cc", ["9.0", "8.0"])
@pytest.mark.parametrize("name,spec", SPECS, ids=[n for n, _ in SPECS])
def test_auto_takes_the_gpu_kernel_at_the_flagship_shapes(name, spec, cc, monkeypatch):
    from longctx.attention import dispatch
    from longctx.models.decoder import build_model

    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: cc)
    kernel = HOPPER if cc == "9.0" else KERNEL
    from longctx.train.sequence_parallel import attention_cores

    cfg = _config(spec)
    assert cfg.model.dtype == "bfloat16", (name, cfg.model.dtype)
    assert cfg.train.seq_len % (cfg.train.window or cfg.train.seq_len) == 0
    # every layer of a launch without a pattern builds the same core, whose choice depends on its settings and the
    # call shapes, not on the depth: two layers stand for the launch's 6-48 (an abstract build costs per layer)
    assert not cfg.model.attention.get("pattern"), name
    cfg.model.num_layers = 2
    cfg.model.scan_layers = "off"  # the cores one by one (a scanned stack holds each parameter stacked over layers)
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0, execution=cfg.execution))
    cores = attention_cores(model)
    assert cores, name
    for core in cores:
        assert core.cfg.impl == "auto", (name, core.cfg.impl)
        choice = _cuda_choice(core, cfg)
        if name in REFUSED:
            fallback, why = REFUSED[name]
            assert choice.name == fallback, (name, choice)
            assert any(why in r for r in choice.reasons), (name, choice.reasons)
        else:
            assert choice.name == kernel[core.name], (name, choice)
            assert not choice.interpret and choice.platform == "cuda", (name, choice)


def test_every_method_of_the_flagships_has_its_kernel_named():
    methods = {_config(spec).model.attention.name for _, spec in SPECS}
    assert methods == set(KERNEL), methods
