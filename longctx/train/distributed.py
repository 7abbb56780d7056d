"""Multi-host start-up: ``jax.distributed.initialize()`` when the environment describes a
multi-process job, and the rule that only process 0 writes logs and plots.

Detected (any one suffices):

* ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``): an explicit launch;
* ``SLURM_NTASKS`` > 1 (``srun``): JAX reads the SLURM variables itself;
* ``TPU_WORKER_HOSTNAMES`` listing more than one host (a TPU pod slice): JAX finds the coordinator;
* ``LONGCTX_DISTRIBUTED=1`` forces it, ``LONGCTX_DISTRIBUTED=0`` disables it.

Each host then reads only its slice of the batch (the batcher is a pure function of
(seed, step, host)), every host takes part in checkpoint saves (orbax coordinates them, and
the primary host writes the metadata), and logging, metrics and plots come from process 0.
"""

from __future__ import annotations

import os

import jax

_initialized = False


def wanted(env=None) -> bool:
    env = os.environ if env is None else env
    flag = env.get("LONGCTX_DISTRIBUTED", "")
    if flag == "0":
        return False
    if flag == "1" or env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize_from_env() -> bool:
    """Initialize JAX's distributed runtime once when the environment asks for it."""
    global _initialized
    if _initialized or not wanted():
        return _initialized
    jax.distributed.initialize()
    _initialized = True
    return True


def is_primary() -> bool:
    return jax.process_index() == 0
