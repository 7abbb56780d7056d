"""One implementation protocol (DESIGN.md "Implementations and the execution section"): every implementation every
method declares, in every direction, is a ``dispatch.Runner`` (a frozen object whose fields are the execution
settings it reads, built for the platform the selection ran on) called one way, ``runner(core, call) -> Result``;
no core writes its own ``__call__`` or selection (``AttentionCore.__call__``: prepare -> select -> run -> finish).

The counts a reader can rerun (the evidence the protocol holds, and what is left where it does not):

    .venv/bin/python tests/attention/test_protocol.py   # calling conventions per method, compatibility sites,
                                                        # platform monkeypatches in tests, import circles, and
                                                        # the lines of plumbing of the guide's skeleton method
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from longctx import attention  # noqa: E402
from longctx.attention import dispatch  # noqa: E402
from longctx.attention.base import AttentionCore  # noqa: E402


def declarations(name: str):
    """Every declaration of method ``name`` in every direction it supports (a name declared per direction counts
    once per direction)."""
    cls = attention.get_class(name)
    out = []
    for causal, supported in ((True, cls.supports_causal), (False, cls.supports_bidirectional)):
        if supported:
            out.extend(cls.implementations(causal=causal))
    return out


def convention(decl) -> str:
    """How a declaration's code is called: the Runner signature, or what else it is."""
    code = decl.code
    if isinstance(code, type) and issubclass(code, dispatch.Runner):
        return "Runner(" + ", ".join(inspect.signature(code.__call__).parameters) + ")"
    return f"{type(code).__name__} {getattr(code, '__name__', '')}".strip()


def calling_conventions() -> dict[str, set[str]]:
    """method -> the distinct calling conventions of its implementations (one: the protocol holds)."""
    return {name: {convention(d) for d in declarations(name)} for name in attention.names()}


# a config read that supplies a default for a key every config has (the base config defines it: only a config
# saved before the key existed could lack it), or a named migration / legacy table
COMPAT_PATTERNS = (r"saved before", r"\bLEGACY", r"\bALIASES\b", r"\bmigrat")


def _config_keys() -> set[str]:
    from longctx import config as config_lib

    keys: set[str] = set()

    def walk(node):
        for k, v in node.items():
            keys.add(k)
            if hasattr(v, "items"):
                walk(v)

    walk(config_lib.base_config())
    for name in attention.names():
        walk(attention.default_config(name))
    return keys


def compatibility_sites() -> list[str]:
    """``file:line: text`` of every compatibility site in the package and configs: a ``cfg.get("key", default)`` (on
    a config-like receiver) of a key the base config always defines, and the named patterns above."""
    keys = _config_keys()
    getter = re.compile(r"\b(?:cfg|c|m|mc|tc|model_cfg|model|vc|lc|cc)(?:\.\w+)*\.get\(\s*[\"'](\w+)[\"']\s*,")
    out = []
    for folder in ("longctx", "configs", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                hit = any(re.search(p, line) for p in COMPAT_PATTERNS)
                hit = hit or any(key in keys for key in getter.findall(line))
                if hit:
                    out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


def platform_monkeypatches() -> list[str]:
    """Tests that change the platform or the resolver by patching (they should pass ``platform=`` instead)."""
    pat = re.compile(r"(monkeypatch\.setattr|mock\.patch)\(.*(current_platform|default_backend|select|platform)")
    out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pat.search(line):
                out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return out


def skeleton_plumbing() -> dict[str, int]:
    """Non-blank lines of each file of the guide's skeleton method (docs/adding_a_method.md)."""
    from tests.attention.test_adding_a_method import skeleton_files

    return {name: sum(1 for line in src.splitlines() if line.strip()) for name, src in skeleton_files().items()}


# -- the laws ------------------------------------------------------------------------------------------------------
def test_every_implementation_is_a_runner_called_one_way():
    bad = {name: conv for name, conv in calling_conventions().items() if len(conv) != 1}
    assert not bad, f"methods with more than one calling convention: {bad}"
    for name in attention.names():
        for decl in declarations(name):
            assert isinstance(decl.code, type) and issubclass(decl.code, dispatch.Runner), (name, decl.name)


def test_a_runners_fields_are_execution_settings_and_its_knobs_reach_it():
    """A runner's fields are execution keys of its method (how, never what), and every per-platform knob its
    declaration resolves is one of its fields (so the knob reaches the code as the platform's value)."""
    for name in attention.names():
        keys = set(attention.get_class(name).EXECUTION_KEYS)
        for decl in declarations(name):
            fields = {f.name for f in dataclasses.fields(decl.code)}
            assert fields <= keys, (name, decl.name, sorted(fields - keys))
            assert set(decl.defaults) <= fields, (name, decl.name, sorted(set(decl.defaults) - fields))


def test_no_core_writes_its_own_call_or_selection():
    for name in attention.names():
        cls = attention.get_class(name)
        assert cls.__call__ is AttentionCore.__call__, f"{name} overrides __call__"
        assert cls.runner is AttentionCore.runner, f"{name} overrides runner"


def test_runner_build_resolves_knobs_for_the_platform():
    @dataclasses.dataclass(frozen=True)
    class Tiles(dispatch.Runner):
        tile: int
        route: str = "plain"

    decl = dispatch.Implementation("tiles", code=Tiles, defaults={"tile": {"cpu": 8, "cuda": 128}})
    assert Tiles.build(decl, {"tile": 0, "route": "fast"}, "cuda") == Tiles(tile=128, route="fast")
    assert Tiles.build(decl, {"tile": 0}, "interpret").tile == 8  # a kernel on a CPU: the CPU's value
    assert Tiles.build(decl, {"tile": 32}, "cuda").tile == 32  # a written value runs as written
    runner = Tiles.build(decl, {"tile": 0}, "cpu")
    try:
        runner.tile = 1
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("a runner's settings must be frozen")


def test_no_compatibility_sites():
    assert compatibility_sites() == []


def test_no_test_patches_the_platform_or_the_resolver():
    assert platform_monkeypatches() == []


if __name__ == "__main__":
    from tests.test_import_graph import circles, import_graph

    conv = calling_conventions()
    print("calling conventions per method:")
    for name, c in conv.items():
        print(f"  {name}: {len(c)}" + ("" if len(c) == 1 else "  " + " | ".join(sorted(c))))
    sites = compatibility_sites()
    print(f"compatibility sites: {len(sites)}")
    for s in sites:
        print("  " + s)
    patches = platform_monkeypatches()
    print(f"tests patching the platform or the resolver: {len(patches)}")
    for s in patches:
        print("  " + s)
    print(f"import circles: {len(circles(import_graph()))}")
    plumbing = skeleton_plumbing()
    print("skeleton method, non-blank lines: " + ", ".join(f"{k} {v}" for k, v in plumbing.items()))
