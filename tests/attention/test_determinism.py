"""Deterministic results on request: where ``XLA_FLAGS`` asks XLA for deterministic GPU ops (JAX's switch, which
also makes cuDNN's attention backward deterministic), the kernels that add with atomic adds on cuda step aside
(``Implementation.atomics``, ``dispatch.deterministic_requested``): 'auto' takes the next implementation, a named
one refuses with the reason. Every kernel's declaration is checked against what its traced gradient does."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dispatch
from tests.attention import kit
from tests.attention.kit import sub_jaxprs
from tests.attention.test_hopper_path import CASES

FLAG = "--xla_gpu_deterministic_ops=true"


@pytest.mark.parametrize("flags,want", [
    ("", None),
    (FLAG, FLAG),
    ("--xla_gpu_deterministic_ops", "--xla_gpu_deterministic_ops"),
    ("--xla_force_host_platform_device_count=8 --xla_gpu_exclude_nondeterministic_ops=TRUE",
     "--xla_gpu_exclude_nondeterministic_ops=TRUE"),
    ("--xla_gpu_deterministic_ops=false", None),
    (f"{FLAG} --xla_gpu_deterministic_ops=false", None),  # the last setting wins, as in XLA
    ("--xla_gpu_deterministic_ops_extra=true", None),
])
def test_deterministic_requested_reads_xla_flags(flags, want):
    assert dispatch.deterministic_requested(flags) == want


def _adds_atomically(jaxpr) -> bool:
    """Whether a traced program (kernel bodies included) adds with atomic operations: Triton's atomic
    read-modify-writes, or a reducing copy to global memory (Mosaic GPU's TMA reductions)."""
    for eqn in jaxpr.eqns:
        if "atomic" in eqn.primitive.name or eqn.params.get("reduction_op") is not None:
            return True
        if any(_adds_atomically(sub) for sub in sub_jaxprs(eqn.params)):
            return True
    return False


def _core(name: str, impl: str):
    cfg, T, _ = CASES[name]
    core = attention.build(name, {**cfg, "impl": impl}, num_heads=2, head_dim=64, causal=True, rngs=nnx.Rngs(0),
                           platform="cuda")
    return core, T


KERNELS = [(name, decl.name) for name in ("eva", "fma", "transformer_vq", "kdeformer")
           for decl in attention.get_class(name).implementations() if decl.kernel]


@pytest.mark.parametrize("name,impl", KERNELS)
def test_a_kernel_declares_atomics_exactly_where_its_gradient_adds_atomically(monkeypatch, name, impl):
    """The gradient of a bf16 full pass traced for cuda (the Triton kernels before Hopper, the Mosaic GPU ones on
    it): an atomic add in any kernel body <=> the declaration lists cuda in ``atomics``."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "9.0" if impl == "mosaic_gpu" else "8.0")
    core, T = _core(name, impl)
    decl = dispatch.by_name(core.implementations())[impl]
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, T, 64), jnp.bfloat16) for i in range(3))

    def loss(q, k, v):
        return jnp.sum(core(q, k, v)[0].astype(jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert _adds_atomically(traced.jaxpr) == ("cuda" in decl.atomics), (name, impl, decl.atomics)


@pytest.mark.parametrize("name", ["eva", "fma", "transformer_vq", "kdeformer"])
def test_deterministic_flags_move_auto_off_the_atomic_kernels(monkeypatch, name):
    """Before Hopper (compute capability 8.0, the Triton kernels): with the flag 'auto' takes no kernel that adds
    atomically and a named one refuses naming the flag; KDEformer's kernel (deterministic) stays; without the
    flag 'auto' takes the kernels as before."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")
    core, T = _core(name, "auto")
    q = jnp.zeros((1, 2, T, 64), jnp.bfloat16)
    _, shapes = core.prepare(q, q, q, None, deterministic=True, key=None)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert core.select(**shapes).name == "pallas"
    monkeypatch.setenv("XLA_FLAGS", FLAG)
    atomic = "cuda" in dispatch.by_name(core.implementations())["pallas"].atomics
    assert (core.select(**shapes).name == "pallas") == (not atomic), name
    named, _ = _core(name, "pallas")
    if atomic:
        with pytest.raises(dispatch.KernelUnsupportedError, match="atomic adds on cuda.*deterministic_ops"):
            named.select(**shapes)
    else:
        assert named.select(**shapes).name == "pallas"


def test_the_kernels_a_compile_selected_are_named_with_the_other_implementations(monkeypatch):
    """``dispatch.chosen`` records what selection picked while a program was traced; the trainer's note
    (``loop.kernels_note``, printed after its first compile and before a compile error) names the Pallas kernels
    among them compiled for an accelerator and what each method's ``impl`` can name instead; none on a CPU."""
    from longctx.train.loop import kernels_note
    from tests.conftest import tiny_config

    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "9.0")
    cfg = tiny_config("/no-corpus", "/no-cache")
    for name, impl, traced in (("eva", "auto", "mosaic_gpu"), ("transformer_vq", "auto", "mosaic_gpu")):
        dispatch.forget_chosen()
        core, T = _core(name, impl)
        q = jnp.zeros((1, 2, T, 64), jnp.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.make_jaxpr(lambda q, core=core: core(q, q, q)[0])(q)
        assert dispatch.chosen() == {name: {traced: ("cuda", True)}}
        line = kernels_note(cfg)
        assert line.startswith(f"note: the step compiles our Pallas kernels ({name}: {traced}); "), line
        others = {"eva": "xla", "transformer_vq": "parallel, blocks, stream"}[name]
        assert line.endswith(f"impl names another implementation ({name}: {others})"), line
    dispatch.forget_chosen()
    core = kit.build("eva", True, window_size=8, chunk_size=4, platform="cpu")
    core(*(jnp.zeros((1, 2, 16, 8)),) * 3)
    assert dispatch.chosen() == {"eva": {"xla_cpu": ("cpu", False)}} and kernels_note(cfg) is None
    assert dispatch.kernels_line({"eva": {"pallas": ("interpret", True)}}, {}) is None
