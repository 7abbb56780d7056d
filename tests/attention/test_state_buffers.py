"""Every causal core's ``init_state`` gives each leaf a buffer of its own: the scoring forward, prefill and decoding
steps donate the carried state (``longctx/train/step.py::jit_forward``, ``longctx/sample.py``), and XLA refuses a
call that donates one buffer twice ("Attempt to donate the same buffer twice"); two leaves sharing one array of zeros
(Transformer-VQ's ``segment`` and ``seen`` did) make a validation with a carried state fail."""

from __future__ import annotations

import jax
import pytest

from longctx import attention
from longctx.bench.cores import build_core

# cores whose state the model builds (a stack wrapper): no core-level state to check
NO_CORE_STATE = {name for name in attention.names()
                 if attention.get_class(name).stack_wrapper(causal=True) is not None}


@pytest.mark.parametrize("name", sorted(set(attention.names()) - NO_CORE_STATE))
def test_init_state_leaves_own_their_buffers(name):
    core = build_core(name, {"max_len": 256} if "max_len" in attention.get_class(name).default_config() else None,
                      heads=2, head_dim=16, causal=True, seed=0)
    leaves = [x for x in jax.tree.leaves(core.init_state(2, 256)) if isinstance(x, jax.Array)]
    assert leaves
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers), f"{name}: init_state shares a buffer between leaves"
