"""The built-in corpus: the running interpreter's standard-library Python sources.

No download. Documents are files, in sorted order of their relative POSIX path;
each file goes to train / valid / test by a stable hash of that path
(90 / 5 / 5 of the hash space). ``site-packages`` and caches are excluded.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from longctx.errors import DataError

SPLIT_BUCKETS = {"train": range(0, 90), "valid": range(90, 95), "test": range(95, 100)}
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the .py files under root, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                out.append(Path(dirpath, f).relative_to(root).as_posix())
    return sorted(out)


def split_of(relpath: str) -> str:
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 100
    for split, buckets in SPLIT_BUCKETS.items():
        if bucket in buckets:
            return split
    raise AssertionError(bucket)


class BuiltinSource:
    name = "builtin"
    splits = ("train", "valid", "test")
    default_tokenizer = "bytes"

    def __init__(self, data_cfg=None, root: str | os.PathLike | None = None):
        path = getattr(data_cfg, "path", "") if data_cfg is not None else ""
        self.root = Path(root or path or stdlib_root())
        self._files = list_files(self.root)
        if not self._files:
            raise DataError(f"built-in corpus: no .py files under {self.root}; set data.path to a folder of .py files")

    def files(self, split: str) -> list[str]:
        return [f for f in self._files if split_of(f) == split]

    def metadata(self) -> dict:
        h = hashlib.sha256()
        counts = {s: {"files": 0, "bytes": 0} for s in self.splits}
        total = 0
        for rel in self._files:
            data = (self.root / rel).read_bytes()
            h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
            counts[split_of(rel)]["files"] += 1
            counts[split_of(rel)]["bytes"] += len(data)
            total += len(data)
        return {
            "source": self.name,
            "python_version": sys.version.split()[0],
            "root": str(self.root),
            "file_count": len(self._files),
            "byte_count": total,
            "splits": counts,
            "content_hash": h.hexdigest(),
        }

    def documents(self, split: str):
        for rel in self.files(split):
            yield rel, (self.root / rel).read_bytes()
