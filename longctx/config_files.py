"""Config files: where they live and how ``FILE[:VARIANT]`` loads.

A config file is a Python file whose ``get_config(arg=None)`` returns an
``ml_collections.ConfigDict`` built on :func:`longctx.config.base_config`. As in big_vision,
``--config=configs/builtin/vcc.py:tiny`` calls ``get_config("tiny")``: a file with variants names
them in a module-level ``VARIANTS`` tuple (``:tiny`` is the 2-layer smoke run of most configs),
and an unknown variant is refused in one line that lists the allowed ones.

Where they live. The repository's ``configs/`` folder is also the Python package ``configs``,
installed beside ``longctx`` (pyproject's ``packages.find`` includes it), so a checkout, an
editable install and ``pip install .`` all have it at ``<folder of the longctx package>/../configs``
(:data:`CONFIG_DIR`). A ``--config`` path is read as given when that file exists (relative to the
working directory); a relative path that does not exist there is looked up against the project:
``configs/default.py`` (or ``default.py``) means ``CONFIG_DIR/default.py``. So
``longctx-train --config=configs/default.py`` works from any directory, and a file of one's own
anywhere on disk still loads.

Configs start from one another with a plain import (``from configs import default`` or
``from configs.builtin import fma``); :func:`load` makes sure the name ``configs`` means
:data:`CONFIG_DIR` before it runs a file, whatever the working directory.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

from longctx.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT = "configs/default.py"


def split_variant(arg: str) -> tuple[str, str | None]:
    """``'configs/fma.py:tiny'`` -> ``('configs/fma.py', 'tiny')``; no variant -> ``(arg, None)``."""
    head, sep, tail = str(arg).rpartition(":")
    if sep and head.endswith(".py") and "/" not in tail:
        return head, tail
    return str(arg), None


def find(path: str | Path) -> Path:
    """The config file ``path`` names: as given if it exists, else a relative path under the project's
    configs (``configs/x.py`` or ``x.py`` -> ``CONFIG_DIR/x.py``)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_absolute():
        for cand in (CONFIG_DIR.parent / p, CONFIG_DIR / p):
            if cand.is_file():
                return cand
    where = "" if p.is_absolute() else f" (looked in the working directory and in {CONFIG_DIR})"
    raise ConfigError(f"config file {path} not found{where}; see --help for the shipped configs")


def ensure_package() -> None:
    """Make ``import configs`` resolve to :data:`CONFIG_DIR` (the configs import one another)."""
    want = CONFIG_DIR.resolve()
    mod = sys.modules.get("configs")
    if mod is not None and any(Path(p).resolve() == want for p in getattr(mod, "__path__", [])):
        return
    if mod is None:
        try:
            spec = importlib.util.find_spec("configs")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and any(Path(p).resolve() == want for p in spec.submodule_search_locations or []):
            return
    for name in [n for n in sys.modules if n == "configs" or n.startswith("configs.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("configs", CONFIG_DIR / "__init__.py",
                                                  submodule_search_locations=[str(CONFIG_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["configs"] = module
    spec.loader.exec_module(module)


def load_module(file: Path):
    """Run the config file ``file`` as a fresh module (by path, so any file loads)."""
    ensure_package()
    spec = importlib.util.spec_from_file_location(f"_longctx_config_{Path(file).stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- a user's file failing at import: one line, no traceback
        first = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        raise ConfigError(f"cannot load the config file {file}: {type(e).__name__}: {first}") from None
    return module


def variants_of(module) -> tuple[str, ...]:
    return tuple(getattr(module, "VARIANTS", ()))


def load(arg: str):
    """``get_config(variant)`` of the config file ``arg`` (``FILE`` or ``FILE:VARIANT``)."""
    import ml_collections

    path, variant = split_variant(arg)
    if not path:
        raise ConfigError("--config needs a file, e.g. --config=configs/default.py (see --help for the list)")
    file = find(path)
    module = load_module(file)
    get = getattr(module, "get_config", None)
    if not callable(get):
        raise ConfigError(f"{path} is not a config file: it defines no get_config() function "
                          "(a config file defines get_config(arg=None) returning a ConfigDict)")
    allowed = variants_of(module)
    takes_arg = bool(inspect.signature(get).parameters)
    if variant is not None:
        if allowed and variant not in allowed:
            raise ConfigError(f"{path}: unknown variant {variant!r}; allowed: {', '.join(allowed)}")
        if not allowed and not takes_arg:
            raise ConfigError(f"{path} has no variants; use --config={path} without ':{variant}'")
    try:
        cfg = get(variant) if variant is not None else get()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- a user's get_config failing: one line, no traceback
        where = f"{path}:{variant}" if variant is not None else path
        first = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        raise ConfigError(f"--config={where}: get_config failed: {type(e).__name__}: {first}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not an ml_collections.ConfigDict")
    return cfg


def _declared_variants(file: Path) -> tuple[str, ...]:
    """A file's ``VARIANTS`` read from its source (no import, so listing stays cheap)."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "VARIANTS" for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except ValueError:
                return ()
    return ()


def shipped() -> list[tuple[str, tuple[str, ...]]]:
    """``[('configs/default.py', ('tiny',)), ...]``: every shipped config file and its variants."""
    out = []
    for f in sorted(CONFIG_DIR.rglob("*.py")):
        rel = f.relative_to(CONFIG_DIR)
        if any(part.startswith("_") for part in rel.parts):
            continue  # __init__.py and shared helpers (_common.py) are not configs
        out.append((f"configs/{rel.as_posix()}", _declared_variants(f)))
    return out


def listing(width: int = 100) -> str:
    """The shipped configs, one folder a line, for ``--help``."""
    groups: dict[str, list[str]] = {}
    for name, variants in shipped():
        folder, _, base = name.rpartition("/")
        groups.setdefault(folder, []).append(base + (f"[:{'|'.join(variants)}]" if variants else ""))
    lines = []
    for folder, names in groups.items():
        head = f"  {folder}/: "
        line = head
        for n in names:
            if len(line) + len(n) + 1 > width and line != head:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += n + " "
        lines.append(line.rstrip())
    return "\n".join(lines)
