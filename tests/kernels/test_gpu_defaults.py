"""What ``impl='auto'`` runs on an NVIDIA GPU for every flagship launch (the ``:node8`` variants of
scripts/flagship_plans.py): each config's attention core is built abstractly and asked, through its own
selection function, which implementation it takes on ``platform='cuda'`` at the launch's call shapes (the
training window, the core's head dims, bfloat16). The Pallas kernel where the method has one, cuDNN for dense,
except where a kernel refuses the call: those refusals are listed here with the refusing rule's words."""

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

# the kernel 'auto' should take on a GPU per method (the method's own Pallas kernel; cuDNN for exact attention)
KERNEL = {"transformer_vq": "pallas", "eva": "pallas", "fma": "pallas", "dense": "cudnn"}

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


def _cuda_choice(core, cfg, monkeypatch):
    """The ``dispatch.Choice`` the core's own selection makes for one training call on 'cuda'."""
    from longctx.attention import dispatch

    core.platform = "cuda"  # the core as a GPU run builds it (it selects for the platform it was built for)
    T, dt = int(cfg.train.window or cfg.train.seq_len), jnp.bfloat16
    if core.name == "dense":
        from longctx.attention.dense.layer import choose

        return choose(core.cfg.impl, dtype=dt, head_dim=core.head_dim, value_dim=core.value_dim, kv_cache=False,
                      large=T * T > core.cfg.auto_threshold, platform="cuda", causal=core.causal)
    if core.name == "transformer_vq":
        shards = int(cfg.mesh.data) * int(cfg.mesh.fsdp) * int(cfg.train.microbatches)
        return core.implementation_for(B=max(1, cfg.train.batch_size // shards), T=T, dtype=dt)
    if core.name == "eva":
        # a training step: one window per row (the full pass), deterministic=False, so with the config's attention
        # dropout (WikiText-103: 0.1)
        return core._select(T, streaming=False, deterministic=False)
    if core.name == "fma":
        seen = []
        select = dispatch.select
        monkeypatch.setattr(dispatch, "select", lambda *a, **kw: seen.append(select(*a, **kw)) or seen[-1])
        core._implementation(None)  # no attention dropout in the flagship launch
        return seen[-1]
    raise AssertionError(f"no selection rule known for {core.name}")


@pytest.mark.parametrize("name,spec", SPECS, ids=[n for n, _ in SPECS])
def test_auto_takes_the_gpu_kernel_at_the_flagship_shapes(name, spec, monkeypatch):
    from longctx.models.decoder import build_model
    from longctx.train.sequence_parallel import attention_cores

    cfg = _config(spec)
    assert cfg.model.dtype == "bfloat16", (name, cfg.model.dtype)
    assert cfg.train.seq_len % (cfg.train.window or cfg.train.seq_len) == 0
    # every layer of a launch without a pattern builds the same core, whose choice depends on its settings and the
    # call shapes, not on the depth: two layers stand for the launch's 6-48 (an abstract build costs per layer)
    assert not cfg.model.attention.get("pattern"), name
    cfg.model.num_layers = 2
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0, execution=cfg.execution))
    cores = attention_cores(model)
    assert cores, name
    for core in cores:
        assert core.cfg.impl == "auto", (name, core.cfg.impl)
        choice = _cuda_choice(core, cfg, monkeypatch)
        monkeypatch.undo()
        if name in REFUSED:
            fallback, why = REFUSED[name]
            assert choice.name == fallback, (name, choice)
            assert any(why in r for r in choice.reasons), (name, choice.reasons)
        else:
            assert choice.name == KERNEL[core.name], (name, choice)
            assert not choice.interpret and choice.platform == "cuda", (name, choice)


def test_every_method_of_the_flagships_has_its_kernel_named():
    methods = {_config(spec).model.attention.name for _, spec in SPECS}
    assert methods == set(KERNEL), methods
