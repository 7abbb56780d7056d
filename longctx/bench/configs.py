"""Experiment configs for the benchmarks that train: ``configs/default.py`` (or
``configs/builtin/<method>.py`` when that file exists) plus ``--set key=value`` overrides."""

from __future__ import annotations

import runpy
from pathlib import Path

import ml_collections

from longctx.runtime import apply_overrides

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("data", "model", "train", "eval", "sample", "mesh")


def load_config_file(path: str | Path) -> ml_collections.ConfigDict:
    return runpy.run_path(str(path))["get_config"]()


def default_config() -> ml_collections.ConfigDict:
    return load_config_file(REPO / "configs" / "default.py")


def method_config(method: str) -> tuple[ml_collections.ConfigDict, str]:
    """(config, source file): ``configs/builtin/<method>.py`` if it exists, else configs/default.py with
    ``model.attention.name = method``."""
    special = REPO / "configs" / "builtin" / f"{method}.py"
    if special.exists():
        cfg = load_config_file(special)
        cfg.model.attention.name = method
        return cfg, str(special.relative_to(REPO))
    cfg = default_config()
    cfg.model.attention.name = method
    return cfg, "configs/default.py"


def with_overrides(cfg: ml_collections.ConfigDict, sets: list[str] | None) -> ml_collections.ConfigDict:
    return apply_overrides(cfg, list(sets or []), allowed_sections=SECTIONS)
