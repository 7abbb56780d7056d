"""Small helpers shared by the real-dataset sources (enwik8, wikitext103, pg19)."""

from __future__ import annotations

from pathlib import Path

from longctx.data.prepare import atomic_write_with, sha256_file  # noqa: F401  (re-exported)


def option(data_cfg, key: str, default):
    """``data_cfg.options[key]``, or ``default`` when the config (or an old saved one) lacks it."""
    opts = getattr(data_cfg, "options", None) if data_cfg is not None else None
    if opts is None:
        return default
    try:
        return opts[key] if key in opts else default
    except TypeError:
        return getattr(opts, key, default)


def data_path(data_cfg) -> str:
    return str(getattr(data_cfg, "path", "") or "") if data_cfg is not None else ""


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_with(path, lambda f: f.write(data))


def drop_manifests(directory: Path) -> None:
    """Remove split manifests so token files made with an older tokenizer are rebuilt."""
    if directory.exists():
        for man in directory.glob("*.json"):
            man.unlink()
