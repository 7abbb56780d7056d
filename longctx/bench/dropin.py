"""Training-free "drop-in" settings for the quality benchmark: how a method with learned
parts is compared with exact softmax attention on the same q, k, v without training.

Each method declares its setting through ``AttentionCore.drop_in()`` (see
``longctx.attention.base.DropIn``):

* a method that declares one runs in that setting;
* a parameter-free method (no ``nnx.Param``) runs as it is;
* any other method with learned parts is reported as 'n/a' with the reason (no mode is
  invented for it).
"""

from __future__ import annotations

from longctx import attention
from longctx.attention.base import DropIn
from longctx.bench.cores import build_core, has_params


def resolve(method: str, overrides: dict, *, heads: int, head_dim: int, causal: bool) -> tuple[DropIn | None, str]:
    """(DropIn, description) or (None, reason it is n/a). Raises ConfigError for an unsupported direction."""
    d = attention.get_class(method).drop_in()
    if d is not None:
        return DropIn(d.description, {**overrides, **d.overrides}, d.setup), d.description
    core = build_core(method, overrides, heads=heads, head_dim=head_dim, causal=causal)
    if not has_params(core):
        return DropIn("parameter-free: used as is", dict(overrides)), "parameter-free: used as is"
    return None, ("n/a: the method has learned parameters and no training-free drop-in setting "
                  "(declare one with AttentionCore.drop_in())")
