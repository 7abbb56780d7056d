"""Multi-host start-up: ``jax.distributed.initialize()`` when the environment describes a
multi-process job, and the rule that only process 0 writes logs and plots.

Detected (any one suffices):

* ``JAX_COORDINATOR_ADDRESS`` (``host:port``) with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``: an
  explicit launch (JAX itself reads only the address; the count and the id are read here and passed
  on, and a missing or out-of-range one is a one-line error);
* ``SLURM_NTASKS`` > 1 (``srun``): JAX reads the SLURM variables itself (``SLURM_JOB_NODELIST``,
  ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``; the port from ``JAX_COORDINATOR_PORT`` or the
  job id);
* ``TPU_WORKER_HOSTNAMES`` listing more than one host (a TPU pod slice): JAX finds the coordinator;
* ``LONGCTX_DISTRIBUTED=1`` forces it, ``LONGCTX_DISTRIBUTED=0`` disables it.

Time limits (seconds, environment): ``LONGCTX_DIST_INIT_TIMEOUT`` (default 300) bounds the wait for
every process to connect, so an unreachable coordinator or a missing process is an error, not a
hang; ``LONGCTX_DIST_HEARTBEAT_TIMEOUT`` (default 100) is how long a silent process (killed, or its
host lost) goes unnoticed before the others stop; ``LONGCTX_DIST_SHUTDOWN_TIMEOUT`` (default 300)
bounds the wait for the others at exit. On CPU the cross-process collectives use gloo.

Each host then reads only its slice of the batch (the batcher is a pure function of
(seed, step, host)), every host takes part in checkpoint saves (orbax coordinates them, and
the primary host writes the metadata), and logging, metrics and plots come from process 0.
"""

from __future__ import annotations

import os

import jax

from longctx.errors import ConfigError

_initialized = False

TIMEOUTS = {  # environment variable -> (jax.distributed.initialize argument, default seconds)
    "LONGCTX_DIST_INIT_TIMEOUT": ("initialization_timeout", 300),
    "LONGCTX_DIST_HEARTBEAT_TIMEOUT": ("heartbeat_timeout_seconds", 100),
    "LONGCTX_DIST_SHUTDOWN_TIMEOUT": ("shutdown_timeout_seconds", 300),
}


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


def _int(env, name: str, *, minimum: int) -> int:
    raw = env.get(name, "")
    try:
        val = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} must be an integer") from None
    if val < minimum:
        raise ConfigError(f"{name}={val} must be >= {minimum}")
    return val


def init_args(env=None) -> dict:
    """The arguments of ``jax.distributed.initialize`` this environment asks for; a mis-set one is a
    :class:`ConfigError` naming it."""
    env = os.environ if env is None else env
    args = {arg: _int(env, name, minimum=1) if env.get(name) else default for name, (arg, default) in TIMEOUTS.items()}
    coord = env.get("JAX_COORDINATOR_ADDRESS", "")
    if coord:
        host, _, port = coord.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"JAX_COORDINATOR_ADDRESS={coord!r} must be host:port (the address of process 0)")
        args["coordinator_address"] = coord
        missing = [n for n in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(n)]
        if missing and not (env.get("SLURM_NTASKS") or env.get("TPU_WORKER_HOSTNAMES")):
            raise ConfigError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} not: set the number of "
                              "processes and this process's id (0 .. number - 1) too")
    if env.get("JAX_NUM_PROCESSES") or env.get("JAX_PROCESS_ID"):
        n = _int(env, "JAX_NUM_PROCESSES", minimum=1) if env.get("JAX_NUM_PROCESSES") else None
        pid = _int(env, "JAX_PROCESS_ID", minimum=0) if env.get("JAX_PROCESS_ID") else None
        if n is not None and pid is not None and pid >= n:
            raise ConfigError(f"JAX_PROCESS_ID={pid} is out of range for JAX_NUM_PROCESSES={n} (ids are 0 .. {n - 1})")
        if n is not None:
            args["num_processes"] = n
        if pid is not None:
            args["process_id"] = pid
    return args


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) until process 0's coordinator accepts connections at ``address``;
    else a ConfigError (JAX's own client aborts the process with a stack trace instead)."""
    import socket
    import time

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    why = "no answer"
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, max(timeout, 0.1))):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(f"the coordinator JAX_COORDINATOR_ADDRESS={address} did not answer within {timeout:.0f} s "
                              f"({why}); start process 0 there, or fix the address (LONGCTX_DIST_INIT_TIMEOUT sets the "
                              "wait)")
        time.sleep(0.25)


def initialize_from_env() -> bool:
    """Initialize JAX's distributed runtime once when the environment asks for it. A failure to
    connect (an unreachable coordinator, a process missing past the init timeout) is a ConfigError."""
    global _initialized
    if _initialized or not wanted():
        return _initialized
    args = init_args()
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.get("coordinator_address") and args.get("process_id", 0) != 0:
        wait_for_coordinator(args["coordinator_address"], args["initialization_timeout"])
    try:
        jax.distributed.initialize(**args)
    except (RuntimeError, ValueError, TypeError) as e:  # XlaRuntimeError is a RuntimeError
        text = " ".join(str(e).split())
        where = args.get("coordinator_address", "the coordinator JAX detected")
        raise ConfigError(f"could not join the multi-process job at {where} within "
                          f"{args['initialization_timeout']} s ({text[:200]}); check JAX_COORDINATOR_ADDRESS, "
                          "JAX_NUM_PROCESSES and JAX_PROCESS_ID, and that every process was started") from None
    _initialized = True
    return True


def is_primary() -> bool:
    return jax.process_index() == 0
