"""One training per workdir: ``WORKDIR/train.lock`` holds the trainer's pid and host.

The holder keeps the file open under an exclusive ``flock``, which the kernel drops when the
process dies (SIGKILL included), so a lock left by a dead trainer is stale by construction. The
pid and host written in it name the holder in the refusal, and serve as a second check on file
systems that do not honour ``flock``: a lock naming a live process on this host is never taken.
A stale lock is taken over with one warning line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from longctx.errors import WorkdirError

LOCK_NAME = "train.lock"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
        if isinstance(data, dict):
            pid = data.get("pid")
            return {"pid": pid if isinstance(pid, int) else None, "host": str(data.get("host", "?"))}
    except (OSError, ValueError):
        pass
    return {}


class WorkdirLock:
    """``acquire()`` or raise :class:`WorkdirError`; ``release()`` removes the lock file."""

    def __init__(self, workdir: str | Path, *, warn=None):
        self.path = Path(workdir) / LOCK_NAME
        self.fd: int | None = None
        self._warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def acquire(self) -> WorkdirLock:
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise WorkdirError(f"cannot create the lock file {self.path} ({e.strerror}); --workdir must be a "
                                   "writable folder") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise WorkdirError(self._busy(holder)) from None
                raise WorkdirError(f"cannot lock {self.path} ({e.strerror})") from None
            try:  # the file may have been removed (released) between open and flock: lock the current one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = _read_holder(fd)
            if holder.get("pid") and holder["pid"] != me["pid"]:
                if holder["host"] == me["host"] and _pid_alive(holder["pid"]):
                    os.close(fd)  # a file system without flock: trust the pid
                    raise WorkdirError(self._busy(holder))
                self._warn(f"warning: taking over the stale lock {self.path} of process {holder['pid']} on "
                           f"{holder['host']} (no longer running)")
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
            self.fd = fd
            return self
        raise WorkdirError(f"cannot lock {self.path}: it keeps changing; is another training starting there?")

    def _busy(self, holder: dict) -> str:
        who = (f"process {holder['pid']} on {holder['host']}" if holder.get("pid") else "another process")
        return (f"another training ({who}) is running in {self.path.parent}; wait for it to finish, stop it, or "
                f"use another --workdir (the lock is {self.path})")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        except OSError:
            pass
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
