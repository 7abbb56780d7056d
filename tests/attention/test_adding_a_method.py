"""docs/adding_a_method.md cannot drift from the code: its skeleton method (every Python block whose first line names
a file under ``longctx/attention/local_softmax/``) is written out as a package, registered, and run through the
shared laws it claims to get for free: every contract law in each direction, the implementation law, the compute
dtype and the per-platform knobs. The registration is undone afterwards."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from longctx import attention
from tests.attention import test_compute_dtype as dtype_laws
from tests.attention import test_contract as contract
from tests.attention import test_implementations as implementation_laws
from tests.attention import test_platform_defaults as knob_laws

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "adding_a_method.md"
NAME = "local_softmax"
PREFIX = f"# longctx/attention/{NAME}/"

pytestmark = pytest.mark.xdist_group("adding-a-method")  # one worker: the package is registered once


def skeleton_files() -> dict[str, str]:
    """file name -> source, from the guide's Python blocks."""
    out = {}
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S):
        first = block.splitlines()[0]
        if first.startswith(PREFIX):
            out[first[len(PREFIX):].strip()] = block
    return out


@pytest.fixture(scope="module")
def method(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skeleton")
    (folder / NAME).mkdir()
    for name, src in skeleton_files().items():
        (folder / NAME / name).write_text(src)
    import longctx.attention as pkg

    pkg.__path__.append(str(folder))
    attention.register(NAME, f"longctx.attention.{NAME}:LocalSoftmax")
    try:
        yield NAME
    finally:
        attention._METHODS.pop(NAME, None)
        attention._loaded.pop(NAME, None)
        pkg.__path__.remove(str(folder))
        for mod in [m for m in sys.modules if m.startswith(f"longctx.attention.{NAME}")]:
            del sys.modules[mod]


def test_the_guide_holds_the_whole_skeleton():
    assert set(skeleton_files()) == {"reference.py", "xla.py", "layer.py", "__init__.py"}


CASE_LAWS = [contract.test_parameters_name_their_logical_axes, contract.test_shapes_dtypes_jit_and_vmap,
             contract.test_streamed_uneven_chunks_equal_full, contract.test_token_by_token_decoding_equals_full,
             contract.test_no_future_leak_by_perturbation_and_jacobian, contract.test_ragged_prefix_equals_full,
             contract.test_state_capacity_is_never_exceeded_silently]


@pytest.mark.parametrize("direction", ["causal", "bidirectional"])
def test_the_skeleton_passes_the_contract(method, direction):
    cls = attention.get_class(method)
    for cname, case in cls.contract_cases().items():
        if direction not in case.directions:
            continue
        laws = CASE_LAWS if direction == "causal" else (
            CASE_LAWS[:2] + [contract.test_bidirectional_sees_later_tokens, contract.test_bidirectional_ragged_lengths])
        for law in laws:
            law(method, cname, direction)
        for dtype in ("float32", "bfloat16"):
            contract.test_finite_gradients_with_large_logits(method, cname, direction, dtype)


@pytest.mark.parametrize("direction", ["causal", "bidirectional"])
def test_the_skeleton_passes_the_implementation_laws(method, direction):
    impls = attention.get_class(method).implementations(causal=direction == "causal")
    assert [i.name for i in impls] == ["reference", "chunked"]
    for impl in impls[1:]:
        for dtype in ("float32", "bfloat16"):
            implementation_laws.test_implementation_equals_reference(method, direction, impl.name, dtype)
        dtype_laws.test_bf16_reaches_every_matmul_of_the_attention_path(method, direction, impl.name)
    knob_laws.test_numeric_knobs_default_to_the_platform(method)
    knob_laws.test_accelerator_implementations_declare_accelerator_values(method)
