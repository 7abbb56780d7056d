"""One shared test base for every Pallas kernel (DESIGN.md §3, STYLE §1–2, house rules 2–3).

A kernel's test subclasses :class:`KernelTestBase` and fills in data, never test code:

* ``kernel(*args, interpret, platform, **static)`` and ``reference(*args, **static)``: same outputs (a pytree);
* ``make_inputs(shape, dtype)`` -> ``(args, static)`` for a named entry of ``SHAPES`` (ragged lengths, carried
  state, ...); ``DIFF_ARGNUMS``: the float arguments the gradient test differentiates;
* ``FORWARD_CASES`` / ``GRAD_CASES``: ``(shape name, dtype name)`` pairs; ``TOLERANCES`` / ``GRAD_TOLERANCES``:
  per dtype ``(atol, rtol)`` (rtol is relative to the largest reference magnitude of that output);
* ``STATE``: a function picking the final state out of the outputs (None if the kernel returns none);
* ``KERNEL_BACKWARD``: False when the kernel has no backward kernel (a ``custom_vjp`` whose backward is
  ``jax.vjp`` of the reference). The gradient test then still differentiates the kernel-based function and
  compares it with autodiff of the reference: it checks the custom VJP's wiring (residuals, argument order,
  dtype casts, padding), not a backward kernel; the test records ``backward`` = "reference VJP" so a report
  says which it is;
* ``EXPORT_CASES``: ``(platform, shape name, dtype name)``; the kernel is lowered with
  ``jax.export.export(jax.jit(f), platforms=[platform])`` (forward and its VJP). Where the kernel's
  ``unsupported_reasons`` refuse the platform/shape, the test instead expects the kernel to raise a
  ``ValueError`` naming them;
* coverage (``test_case_coverage``): ``is_ragged(shape)`` says whether a shape's length is not a multiple of the
  kernel's block sizes; ``PAPER_SHAPES`` (or ``paper_shapes(platform)``) names the shapes of the paper's configs; ``EXPORT_PLATFORMS`` the
  platforms this form of the kernel lowers for. Every dtype of ``DTYPES`` needs a ragged forward and gradient
  case, and every platform an export case at every paper shape.

The default suite runs a covering subset of these cases (:meth:`KernelTestBase.default_cases`: every shape, every
dtype at a ragged length, every platform's paper shapes), ``-m slow`` every case.

``INTERPRET`` (default: True on CPU) runs the kernels in Pallas interpret mode; on an accelerator a subclass
with ``INTERPRET = False`` runs the same tests compiled. Each (shape, dtype) compiles once: forward outputs
are cached per class and shared by the forward and final-state tests.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

def mosaic_gpu_mode(interpret, dtype) -> bool:
    """The ``interpret`` flag a Mosaic GPU kernel test runs with: the one given, else Mosaic GPU's interpret mode on
    a CPU and the compiled kernels on a GPU (gpu_check.sh's tests step), where a float32 case skips (the compiled
    kernels take bfloat16 / float16, wgmma would round float32 to tf32; their refusal has its own test)."""
    if interpret is not None:
        return interpret
    if jax.default_backend() != "cpu" and jnp.dtype(dtype) == jnp.float32:
        pytest.skip("compiled Mosaic GPU kernels take bfloat16 / float16 (float32 is refused: tf32)")
    return jax.default_backend() == "cpu"


def _assert_refused(reasons: list[str], run) -> None:
    """``run()`` raises a ValueError whose message names every one of ``reasons``."""
    with pytest.raises(ValueError) as err:
        run()
    for r in reasons:
        assert r in str(err.value)


if jax.default_backend() == "gpu":
    # float32 dots default to TF32 on recent NVIDIA GPUs; the tolerances below are for full float32 products
    # (an H100 run: eva chunk statistics and vq_cache forward off by 1e-4..1.5e-3 at the default precision,
    # within tolerance at 'highest')
    jax.config.update("jax_default_matmul_precision", "highest")
NO_KERNEL_BACKWARD = "reference VJP (custom_vjp backward = jax.vjp of the reference), no backward kernel"


@contextlib.contextmanager
def verified_triton_modules():
    """Inside the block, every Triton module that Pallas lowers (``'cuda'``) is run through MLIR's verifier; yields
    the list of ``(kernel name, error or None)`` it fills, or None where this jax has no such lowering hook.

    ``jax.export`` only serializes the module; a GPU's XLA verifies it when it parses it, so an ill-typed module
    (a loop bound lowered as i1, seen on an H100/H200) exports on CPU and fails only on the GPU. This check moves
    that failure here."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
        orig = reg.lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):
        yield None
        return
    found = []

    def lower_and_verify(*a, **k):
        res = orig(*a, **k)
        op = res.module.operation
        name = next((str(o.attributes["sym_name"]).strip('"') for o in op.regions[0].blocks[0].operations
                     if "sym_name" in o.attributes), "?")
        try:
            found.append((name, None if op.verify() else "verify() returned False"))
        except Exception as e:  # MLIR raises with the verifier's diagnostics
            found.append((name, str(e)[:2000]))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield found
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig


def max_rel_err(ref, out) -> float:
    """max |out - ref| / max(1, max |ref|) over one array."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    return float(np.max(np.abs(out - ref))) / max(1.0, float(np.max(np.abs(ref))))


def assert_close(ref, out, tol, what: str) -> None:
    atol, rtol = tol
    ref_l, out_l = jax.tree.leaves(ref), jax.tree.leaves(out)
    assert len(ref_l) == len(out_l), f"{what}: {len(out_l)} leaves vs {len(ref_l)} in the reference"
    for i, (a, b) in enumerate(zip(ref_l, out_l)):
        assert np.shape(a) == np.shape(b), f"{what}[{i}]: shape {np.shape(b)} vs reference {np.shape(a)}"
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(b64)), f"{what}[{i}]: non-finite values"
        err = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
        bound = atol + rtol * (float(np.max(np.abs(a64))) if a64.size else 0.0)
        assert err <= bound, f"{what}[{i}]: max abs error {err:.3e} > {bound:.3e} (atol {atol}, rtol {rtol})"


def _weights(x, salt: int):
    n = int(np.prod(np.shape(x))) if np.shape(x) else 1
    return jnp.cos(jnp.arange(n, dtype=jnp.float32) * 0.37 + salt).reshape(np.shape(x))


def weighted_sum(tree) -> jax.Array:
    """A loss that weighs every float output element differently (so no gradient can hide in a symmetry)."""
    total = jnp.float32(0.0)
    for i, x in enumerate(jax.tree.leaves(tree)):
        if jnp.issubdtype(x.dtype, jnp.floating):
            total = total + jnp.sum(x.astype(jnp.float32) * _weights(x, i))
    return total


class KernelTestBase:
    INTERPRET: bool = jax.default_backend() == "cpu"
    SHAPES: dict[str, dict] = {}
    FORWARD_CASES: tuple[tuple[str, str], ...] = ()
    GRAD_CASES: tuple[tuple[str, str], ...] = ()
    EXPORT_CASES: tuple[tuple[str, str, str], ...] = ()
    TOLERANCES: dict[str, tuple[float, float]] = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 2e-2)}
    GRAD_TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}
    DIFF_ARGNUMS: tuple[int, ...] = ()
    KERNEL_BACKWARD: bool = True
    PAPER_SHAPES: tuple[str, ...] = ()
    EXPORT_PLATFORMS: tuple[str, ...] = ("tpu", "cuda")
    STATE: Callable[[Any], Any] | None = None

    _cache: dict = {}

    # -- to fill --------------------------------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype) -> tuple[tuple, dict]:
        raise NotImplementedError

    def kernel(self, *args, interpret: bool, platform: str | None = None, **static):
        raise NotImplementedError

    def reference(self, *args, **static):
        raise NotImplementedError

    def unsupported_reasons(self, platform: str, shape: dict, dtype) -> list[str]:
        return []

    def export_disabled_checks(self, platform: str) -> list:
        return []

    def is_ragged(self, shape: dict) -> bool:
        raise NotImplementedError

    def paper_shapes(self, platform: str) -> tuple[str, ...]:
        return self.PAPER_SHAPES

    # -- parametrization ----------------------------------------------------------------------------------------
    def default_cases(self, kind: str, cases) -> set:
        """The cases of ``kind`` ('forward', 'grad', 'export') the default suite runs; the others are marked slow
        (``-m slow`` runs every case). A covering rule, in declared order: a forward or gradient case runs when it
        is the first of its shape, or the first ragged case of its dtype; an export case when it is the first of its
        (platform, shape), or the first of its (platform, dtype). So every shape, every dtype at a ragged length and
        every platform's paper shapes run by default, not every (shape, dtype) pair."""
        keep, seen = set(), set()
        for c in cases:
            if kind == "export":
                keys = [("shape", c[0], c[1]), ("dtype", c[0], c[2])]
            else:
                keys = [("shape", c[0])] + ([("dtype", c[1])] if self.is_ragged(self.SHAPES[c[0]]) else [])
            if any(k not in seen for k in keys):
                keep.add(c)
            seen.update(keys)
        return keep

    def _params(self, kind: str, cases, ident):
        keep = self.default_cases(kind, cases)
        return [pytest.param(c, id=ident(c), marks=() if c in keep else (pytest.mark.slow,)) for c in cases]

    def pytest_generate_tests(self, metafunc):
        params = {
            "forward_case": self._params("forward", self.FORWARD_CASES, lambda c: f"{c[0]}-{c[1]}"),
            "grad_case": self._params("grad", self.GRAD_CASES, lambda c: f"{c[0]}-{c[1]}"),
            "export_case": self._params("export", self.EXPORT_CASES, lambda c: f"{c[0]}-{c[1]}-{c[2]}"),
        }
        for name, values in params.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, values)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _skip_if_not_runnable(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas kernels need an accelerator (set INTERPRET = True on CPU)")

    def _expect_refusal_here(self, shape_name: str, dtype_name: str, run) -> bool:
        """Compiled on an accelerator, a shape the kernel refuses there (its ``unsupported_reasons`` for the
        running platform) must raise a ValueError naming the reasons, as in the export test; True when so."""
        if self.INTERPRET:
            return False
        backend = jax.default_backend()
        platform = {"gpu": "cuda"}.get(backend, backend)
        reasons = self.unsupported_reasons(platform, self.SHAPES[shape_name], DTYPES[dtype_name])
        if not reasons:
            return False
        _assert_refused(reasons, run)
        return True

    def _forward_pair(self, shape_name: str, dtype_name: str):
        key = (type(self).__name__, shape_name, dtype_name)
        if key not in KernelTestBase._cache:
            args, static = self.make_inputs(self.SHAPES[shape_name], DTYPES[dtype_name])
            ref = jax.jit(lambda *a: self.reference(*a, **static))(*args)
            out = jax.jit(lambda *a: self.kernel(*a, interpret=self.INTERPRET, **static))(*args)
            KernelTestBase._cache[key] = (ref, out)
        return KernelTestBase._cache[key]

    # -- shared tests -----------------------------------------------------------------------------------------
    def test_forward_matches_reference(self, forward_case):
        self._skip_if_not_runnable()
        shape_name, dtype_name = forward_case
        if self._expect_refusal_here(shape_name, dtype_name, lambda: self._forward_pair(shape_name, dtype_name)):
            return
        ref, out = self._forward_pair(shape_name, dtype_name)
        assert_close(ref, out, self.TOLERANCES[dtype_name], f"{shape_name}/{dtype_name} outputs")
        # the comparison is not trivially between zeros
        assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref) if x.size) > 1e-2

    def test_final_state_matches_reference(self, forward_case):
        if self.STATE is None:
            pytest.skip("this kernel returns no final state")
        self._skip_if_not_runnable()
        shape_name, dtype_name = forward_case
        if self._expect_refusal_here(shape_name, dtype_name, lambda: self._forward_pair(shape_name, dtype_name)):
            return
        ref, out = self._forward_pair(shape_name, dtype_name)
        st_ref, st_out = type(self).STATE(ref), type(self).STATE(out)
        assert jax.tree.structure(st_ref) == jax.tree.structure(st_out)
        assert_close(st_ref, st_out, self.TOLERANCES[dtype_name], f"{shape_name}/{dtype_name} final state")

    def test_case_coverage(self):
        """Each dtype has a forward and a gradient case at a ragged length; each platform an export case at each
        of the paper's shapes."""
        missing = []
        for kind, cases in (("forward", self.FORWARD_CASES), ("gradient", self.GRAD_CASES)):
            for dt in DTYPES:
                if not any(d == dt and self.is_ragged(self.SHAPES[s]) for s, d in cases):
                    missing.append(f"{kind} {dt} at a ragged length")
        for plat in self.EXPORT_PLATFORMS:
            assert self.paper_shapes(plat), f"no paper shapes named for {plat}"
            for s in self.paper_shapes(plat):
                if not any(p == plat and sh == s for p, sh, _ in self.EXPORT_CASES):
                    missing.append(f"export {plat} at {s}")
        assert not missing, "missing cases: " + "; ".join(missing)

    def test_gradient_matches_autodiff_of_reference(self, grad_case, record_property):
        record_property("backward", "kernel" if self.KERNEL_BACKWARD else NO_KERNEL_BACKWARD)
        self._skip_if_not_runnable()
        shape_name, dtype_name = grad_case
        args, static = self.make_inputs(self.SHAPES[shape_name], DTYPES[dtype_name])

        def grads(fn):
            def loss(*diff):
                full = list(args)
                for i, x in zip(self.DIFF_ARGNUMS, diff):
                    full[i] = x
                return weighted_sum(fn(*full))

            return jax.jit(jax.grad(loss, argnums=tuple(range(len(self.DIFF_ARGNUMS)))))(
                *(args[i] for i in self.DIFF_ARGNUMS))

        kernel_grads = lambda: grads(lambda *a: self.kernel(*a, interpret=self.INTERPRET, **static))  # noqa: E731
        if self._expect_refusal_here(shape_name, dtype_name, kernel_grads):
            return
        g_ref = grads(lambda *a: self.reference(*a, **static))
        g_ker = kernel_grads()
        tol = self.GRAD_TOLERANCES[dtype_name]
        for i, (a, b) in enumerate(zip(g_ref, g_ker)):
            assert_close(a, b, tol, f"{shape_name}/{dtype_name} d/d(arg {self.DIFF_ARGNUMS[i]})")
        assert any(float(jnp.max(jnp.abs(a))) > 1e-3 for a in jax.tree.leaves(g_ref)), "all gradients ~0"

    def test_export_lowering(self, export_case):
        platform, shape_name, dtype_name = export_case
        args, static = self.make_inputs(self.SHAPES[shape_name], DTYPES[dtype_name])
        fwd = lambda *a: self.kernel(*a, interpret=False, platform=platform, **static)  # noqa: E731
        reasons = self.unsupported_reasons(platform, self.SHAPES[shape_name], DTYPES[dtype_name])
        if reasons:  # a refused platform/shape must be a clear error naming the reasons, never a wrong answer
            _assert_refused(reasons, lambda: jax.export.export(jax.jit(fwd), platforms=[platform])(*args))
            return
        disabled = self.export_disabled_checks(platform)
        marker = "tpu_custom_call" if platform == "tpu" else "triton"
        with verified_triton_modules() as triton:
            exp = jax.export.export(jax.jit(fwd), platforms=[platform], disabled_checks=disabled)(*args)
            assert marker in exp.mlir_module()

            def loss(*diff):
                full = list(args)
                for i, x in zip(self.DIFF_ARGNUMS, diff):
                    full[i] = x
                return weighted_sum(fwd(*full))

            g = jax.grad(loss, argnums=tuple(range(len(self.DIFF_ARGNUMS))))
            exp_b = jax.export.export(jax.jit(g), platforms=[platform], disabled_checks=disabled)(
                *(args[i] for i in self.DIFF_ARGNUMS))
            n_fwd = exp.mlir_module().count(marker)
            if self.KERNEL_BACKWARD:  # the backward kernels are in the lowered module
                assert exp_b.mlir_module().count(marker) > n_fwd
            else:  # the VJP (the reference's, in XLA) lowers too; the forward module holds the kernel
                assert n_fwd > 0
        if platform == "cuda" and triton is not None:  # what the GPU's XLA would reject when it parses them
            assert triton, "no Triton module was lowered"
            bad = [f"{name}: {err}" for name, err in triton if err]
            assert not bad, "Triton modules fail MLIR verification:\n" + "\n".join(bad)
