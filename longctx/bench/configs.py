"""Experiment configs for the benchmarks that train or time a whole model: ``configs/default.py``
(or ``configs/builtin/<method>.py`` when that file exists) plus ``--config.KEY=VALUE`` overrides.

Config files are found and loaded as by every entry point (:mod:`longctx.config_files`): a path as given,
else under the project's ``configs`` package, so the benchmarks work from an installed package and from any
working directory. When ``configs/default.py`` is not found they start from :func:`longctx.config.base_config`.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from longctx import config as config_lib
from longctx import config_files
from longctx.config import apply_overrides, base_config
from longctx.errors import ConfigError

SECTIONS = ("data", "model", "train", "eval", "sample", "mesh", "mlm", "execution")  # every section of the config
DEFAULT = "configs/default.py"


def _checkout() -> Path | None:
    """The source tree this package was imported from, if it is one (holds ``configs/`` and ``.git``-style
    project files), for provenance such as the git sha; None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "configs").is_dir() and (root / "longctx").is_dir() and (root / "pyproject.toml").is_file() \
        else None


def find_config(spec: str | Path) -> Path | None:
    """The config file ``spec`` names (variant suffix removed), or None (:func:`longctx.config_files.find`)."""
    path, _ = config_files.split_variant(str(spec))
    try:
        return config_files.find(path)
    except ConfigError:
        return None


def shown(spec: str | Path) -> str:
    """How a config file is named in outputs: relative to the working directory or the project's configs."""
    path, variant = config_files.split_variant(str(spec))
    p = find_config(path)
    text = str(path)
    if p is not None:
        rp = p.resolve()
        for root in (Path.cwd(), config_files.CONFIG_DIR.parent):
            if rp.is_relative_to(root.resolve()):
                text = str(rp.relative_to(root.resolve()))
                break
    return text + (f":{variant}" if variant else "")


def load_config_file(spec: str | Path) -> ml_collections.ConfigDict:
    """``get_config()`` (or ``get_config(variant)`` for ``file.py:variant``) of a config file, loaded as
    every entry point loads one (:func:`longctx.config_files.load`)."""
    return config_files.load(str(spec))


def default_config() -> ml_collections.ConfigDict:
    if find_config(DEFAULT) is not None:
        return load_config_file(DEFAULT)

    return base_config()


def method_config(method: str) -> tuple[ml_collections.ConfigDict, str]:
    """(config, source): ``configs/builtin/<method>.py`` if it is found, else configs/default.py with
    ``model.attention.name = method``."""
    special = f"configs/builtin/{method}.py"
    if find_config(special) is not None:
        cfg = load_config_file(special)
        cfg.model.attention.name = method
        return cfg, special
    cfg = default_config()
    cfg.model.attention.name = method
    return cfg, DEFAULT if find_config(DEFAULT) is not None else "longctx.config.base_config()"


def with_overrides(cfg: ml_collections.ConfigDict, overrides: list[str] | None) -> ml_collections.ConfigDict:
    """``cfg`` with ``KEY=VALUE`` strings applied (the ``--config.KEY=VALUE`` flags)."""
    return apply_overrides(cfg, list(overrides or []), allowed_sections=SECTIONS)


def check_overrides(overrides: list[str] | None) -> None:
    """Raise ConfigError for an override whose key is unknown or whose value does not parse as the
    key's type (checked against the base config, before anything runs)."""

    cfg = with_overrides(config_lib.base_config(), overrides)
    check = getattr(config_lib, "check_ranges", None)  # the allowed range of every numeric key
    if check is not None and overrides:
        try:
            check(config_lib.base_config())
        except ConfigError:
            return  # the base alone fails a range test: leave the checks to the run's full validation
        check(cfg)
