"""The shared base every experiment config starts from.

Experiment files import it as ``from longctx.config import base_config`` and state only what
differs; the keys and their meaning are documented in longctx/config.py.
"""

from longctx.config import base_config


def get_config():
    return base_config()


def gpu_node(c, *, data: int, tensor: int = 1, remat_policy: str | None = None, microbatches: int = 1,
             loss_chunk: int = 0):
    """``c`` as a launch on one GPU node (the ``:node8`` variants): bf16 activations over fp32 master weights, the
    layers stacked and scanned, the mesh ``data`` x ``tensor`` (no FSDP), each block rematerialised under
    ``remat_policy`` when given, ``microbatches`` per update, the softmax NLL over vocabulary chunks of
    ``loss_chunk`` when given."""
    c.model.dtype = "bfloat16"
    c.model.scan_layers = "on"
    if remat_policy:
        c.model.remat = True
        c.model.remat_policy = remat_policy
    if loss_chunk:
        c.model.loss_chunk = loss_chunk
    if microbatches > 1:
        c.train.microbatches = microbatches
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, 1, tensor
    return c
