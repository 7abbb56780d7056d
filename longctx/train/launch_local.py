"""A multi-process job on this machine: N ``longctx-train`` processes on 127.0.0.1, one JAX
distributed runtime, one global mesh over every process's (simulated CPU) devices.

``python -m longctx.train.launch_local N [--devices K] [--logdir DIR] [--grace S] -- <longctx-train args>``
(``scripts/multiprocess_local.sh`` wraps it; absl flags, ``--help`` lists them all, a bad command line is one
``error:`` line and exit status 2, as for every longctx command). Each process gets the environment a cluster launcher
would give it: ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>``, ``JAX_NUM_PROCESSES=N``,
``JAX_PROCESS_ID=i``, ``XLA_FLAGS=--xla_force_host_platform_device_count=K``, CPU collectives over
gloo, and short distributed time limits (a killed process is noticed within seconds). Process i
writes ``DIR/process_<i>.log``; process 0's is also echoed to the terminal.

The job stops by itself: when a process exits non-zero, the others get ``--grace`` seconds to stop
on their own (the distributed runtime notices the missing process), then SIGTERM, then SIGKILL.
The exit status is the first non-zero one, else 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from longctx.cli import flag_help, user_errors
from longctx.errors import ConfigError

TRAIN = "import sys; from longctx.cli import train_main; sys.exit(train_main())"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, port: int, devices: int, base: dict | None = None, *,
                heartbeat: int = 5, init_timeout: int = 60, shutdown_timeout: int = 30) -> dict:
    """The environment of process ``i`` of ``n``."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(n),
        "JAX_PROCESS_ID": str(i),
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
        "LONGCTX_DIST_HEARTBEAT_TIMEOUT": str(heartbeat),
        "LONGCTX_DIST_INIT_TIMEOUT": str(init_timeout),
        "LONGCTX_DIST_SHUTDOWN_TIMEOUT": str(shutdown_timeout),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def start(n: int, train_args: list[str], *, devices: int, logdir: Path, port: int | None = None,
          base_env: dict | None = None, heartbeat: int = 5, init_timeout: int = 60, cwd=None,
          code: str = TRAIN) -> list[subprocess.Popen]:
    """Start the ``n`` processes (stdout and stderr of process i into ``logdir/process_<i>.log``), each
    running ``python -c code train_args`` (``code``: longctx-train; a test may wrap it)."""
    logdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    procs = []
    for i in range(n):
        env = process_env(i, n, port, devices, base_env, heartbeat=heartbeat, init_timeout=init_timeout)
        with open(logdir / f"process_{i}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code, *train_args], stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=cwd))
    return procs


def stop(procs: list[subprocess.Popen], *, grace: float = 10.0) -> None:
    """Let the running processes stop on their own for ``grace`` seconds, then SIGTERM, then SIGKILL."""
    for sig, wait in ((None, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        live = [p for p in procs if p.poll() is None]
        if not live:
            return
        if sig is not None:
            for p in live:
                p.send_signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.1)


def supervise(procs: list[subprocess.Popen], *, grace: float = 10.0, timeout: float | None = None,
              echo=None) -> int:
    """Wait for the job; a non-zero exit (or ``timeout`` seconds) stops the others. Returns the exit status."""
    t0 = time.monotonic()
    status = 0
    try:
        while True:
            if echo is not None:
                echo()
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                print(f"launch_local: process {i} exited with status {status}; stopping the others",
                      file=sys.stderr, flush=True)
                break
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - t0 > timeout:
                print(f"launch_local: the job ran past {timeout:.0f} s; stopping it", file=sys.stderr, flush=True)
                status, grace = 124, 0.0
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        status, grace = 130, 0.0
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        grace = 30.0  # the trainers checkpoint at the next step boundary
    stop(procs, grace=grace)
    if echo is not None:
        echo()
    return status


def _follow(path: Path):
    pos = 0

    def echo():
        nonlocal pos
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
        except OSError:
            return
        if b"\n" in data:
            data = data[:data.rindex(b"\n") + 1]
            pos += len(data)
            sys.stdout.write(data.decode("utf-8", "replace"))
            sys.stdout.flush()

    return echo


USAGE = "N [--devices K] [--logdir DIR] [--grace S] [--heartbeat S] [--timeout S] -- <longctx-train args>"
PROG = "launch_local"


def define_flags(fv) -> None:
    from absl import flags

    env = os.environ.get("LONGCTX_LOCAL_DEVICES", "1")
    try:
        devices = int(env)
    except ValueError:
        raise ConfigError(f"LONGCTX_LOCAL_DEVICES={env!r} must be an integer (simulated CPU devices per "
                          "process)") from None
    flags.DEFINE_integer("devices", devices, "simulated CPU devices per process ($LONGCTX_LOCAL_DEVICES sets the "
                         "default)", flag_values=fv)
    flags.DEFINE_string("logdir", None, "per-process logs (default: <workdir>/logs, else ./logs)", flag_values=fv)
    flags.DEFINE_float("grace", 15.0, "seconds the others may take to stop on their own after one fails",
                       flag_values=fv)
    flags.DEFINE_integer("heartbeat", 5, "seconds before a silent process counts as lost", flag_values=fv)
    flags.DEFINE_float("timeout", None, "stop the whole job after this many seconds", flag_values=fv)


def help_text(fv) -> str:
    return "\n".join([f"usage: scripts/multiprocess_local.sh {USAGE}", f"   or: python -m longctx.train.{PROG} {USAGE}", "", __doc__.split("\n\n")[0].replace("\n", " "), "",
                      "arguments:", "  N: the number of processes", "  after --: the longctx-train command line "
                      "every process runs (without --, the flags this command does not know)", "", "flags:",
                      *flag_help(fv, ("devices", "logdir", "grace", "heartbeat", "timeout"))])


def parse_args(argv: list[str]):
    """(flags as a namespace with ``num_processes``, longctx-train's arguments) of ``argv`` (without the program
    name); a bad command line raises ConfigError (one line), ``--help`` prints the help and exits."""
    from types import SimpleNamespace

    from absl import flags

    fv = flags.FlagValues()
    define_flags(fv)
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)  # the launcher's own flags before it, longctx-train's after
    own, train_args = argv[:at], argv[at + 1:]
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in own):
        print(help_text(fv))
        raise SystemExit(0)
    try:  # without --, the flags this command does not define are longctx-train's
        left = fv([PROG, *own], known_only=at == len(argv))[1:]
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(f"{PROG}: unknown flag --{e.flagname}; allowed: --devices, --logdir, --grace, "
                          "--heartbeat, --timeout (longctx-train's flags go after --)") from None
    except flags.Error as e:
        raise ConfigError(f"{PROG}: {' '.join(str(e).split())}") from None
    positional = [a for a in left if not a.startswith("-")]
    if not positional:
        raise ConfigError(f"{PROG}: the number of processes N is required: {PROG} {USAGE}")
    if at < len(argv) and len(positional) > 1:
        raise ConfigError(f"{PROG}: unexpected argument {positional[1]!r} before --; longctx-train's arguments go "
                          "after --")
    left.remove(positional[0])
    train_args = left + train_args
    try:
        n = int(positional[0])
    except ValueError:
        raise ConfigError(f"{PROG}: N={positional[0]!r} must be the number of processes, a positive integer") from None
    a = SimpleNamespace(num_processes=n, **{k: fv[k].value for k in ("devices", "logdir", "grace", "heartbeat",
                                                                      "timeout")})
    for name, value, ok in (("N", n, n >= 1), ("--devices", a.devices, a.devices >= 1),
                            ("--grace", a.grace, a.grace >= 0), ("--heartbeat", a.heartbeat, a.heartbeat >= 1),
                            ("--timeout", a.timeout, a.timeout is None or a.timeout > 0)):
        if not ok:
            raise ConfigError(f"{PROG}: {name}={value} must be "
                              + ("a positive number of seconds" if name == "--timeout" else
                                 "a number of seconds >= 0" if name == "--grace" else "a positive integer"))
    return a, train_args


def main(argv=None) -> int:
    with user_errors():
        a, train_args = parse_args(sys.argv[1:] if argv is None else argv)
    workdir = next((x.split("=", 1)[1] for x in train_args if x.startswith("--workdir=")), None)
    if a.logdir:
        logdir = Path(a.logdir)
    elif workdir and "://" not in workdir:
        logdir = Path(workdir) / "logs"
    else:
        logdir = Path("logs")
    procs = start(a.num_processes, train_args, devices=a.devices, logdir=logdir, heartbeat=a.heartbeat)
    print(f"launch_local: {a.num_processes} processes x {a.devices} devices on 127.0.0.1; logs in "
          f"{logdir}/process_<i>.log", file=sys.stderr, flush=True)
    status = supervise(procs, grace=a.grace, timeout=a.timeout, echo=_follow(logdir / "process_0.log"))
    if status:
        for i, p in enumerate(procs):
            print(f"launch_local: process {i} (status {p.returncode}): {summary(logdir / f'process_{i}.log')}",
                  file=sys.stderr, flush=True)
    return status


def summary(log: Path) -> str:
    """The line of a process's log that says why it stopped."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    for line in lines:
        if "Terminating process because the JAX distributed service" in line:
            return ("stopped by the JAX distributed runtime: another process died or stopped answering "
                    f"({line.split('] ', 1)[-1][:160]})")
    for line in reversed(lines):
        if line.startswith(("error:", "Error", "stopped by signal")) or "Error:" in line:
            return line
    return lines[-1] if lines else "(no output)"


if __name__ == "__main__":
    sys.exit(main())
