"""Each method is one room: no method name outside its own file, the registry, configs and
tests; kernels never import the package that uses them (no import cycle)."""

import ast
import functools
import subprocess
import sys
from pathlib import Path

from longctx import attention

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _parsed(text: str) -> tuple[list, frozenset]:
    """Every node of ``text``'s syntax tree (``ast.walk`` order) and the ids of its docstring constants: each file is
    parsed and walked once for all the tests of this module (keyed by its text, so a rewritten file is parsed
    again)."""
    nodes = list(ast.walk(ast.parse(text)))
    docs = frozenset(id(n.body[0].value) for n in nodes
                     if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                     and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant))
    return nodes, docs


def _string_literals(path: Path):
    nodes, docs = _parsed(path.read_text())
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_method_name_outside_its_room():
    rooms = {}
    for name in attention.names():
        module = attention._METHODS[name].split(":")[0]
        folder = ROOT / module.replace(".", "/")
        rooms[name] = folder if folder.is_dir() else folder.with_suffix(".py")  # a method's folder, or one file
    offenders = []
    for path in sorted((ROOT / "longctx").rglob("*.py")):
        if path in (ROOT / "longctx/attention/__init__.py", ROOT / "longctx/config.py"):  # registry, base config
            continue
        inside = {name for name, room in rooms.items() if path == room or room in path.parents}  # its own rooms
        for lineno, text in _string_literals(path):
            if text in rooms and text not in inside:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {text!r}")
    assert offenders == [], "method names outside their rooms (ask a capability instead):\n" + "\n".join(offenders)


def _imports(path: Path):
    """(lineno, dotted module) for every import in ``path`` (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    for node in _parsed(path.read_text())[0]:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
            for a in node.names:
                yield node.lineno, f"{node.module}.{a.name}"


CPU_HELPERS = ("longctx.xla_cpu", "pallas_kernels.cpu_dots")


def _python_files():
    for top in ("longctx", "pallas_kernels"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_cpu_helpers_only_inside_cpu_implementations():
    """The XLA:CPU helpers (``longctx/xla_cpu.py``) are imported only by CPU implementations: files named
    ``xla_cpu.py`` (a method's, the model's). Everything else reaches CPU tuning through its implementation's
    name, chosen by the resolver."""
    offenders = []
    for path in _python_files():
        if path.name == "xla_cpu.py":
            continue
        for lineno, mod in _imports(path):
            if any(mod == h or mod.startswith(h + ".") for h in CPU_HELPERS):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: imports {mod}")
    assert not (ROOT / "pallas_kernels/cpu_dots.py").exists(), "the CPU helpers live in longctx/xla_cpu.py"
    assert offenders == [], "CPU helpers outside a CPU implementation:\n" + "\n".join(offenders)


def _code_mentions(path, words):
    """(line, what) of every identifier, attribute, import alias or non-docstring string constant of ``path``'s code
    that is one of ``words`` or contains one (comments and docstrings may name a file; code may not use it)."""
    nodes, docstrings = _parsed(path.read_text())
    for node in nodes:
        text = None
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = f"{node.name} {node.asname or ''}".strip()
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        if text and any(w in text for w in words):
            yield getattr(node, "lineno", 0), text[:80]


def test_cpu_tuning_is_named_only_inside_cpu_implementations():
    """No code outside files named ``xla_cpu.py`` names the CPU implementation or its helpers (``xla_cpu``,
    ``cpu_dots`` as an identifier, attribute, import or string): an implementation declares itself in its own
    module (``IMPLEMENTATIONS``, collected by ``dispatch.declared``), so no layer or portable implementation has to
    name it. Comments and docstrings may name the file."""
    offenders = []
    for path in _python_files():
        if path.name == "xla_cpu.py":
            continue
        for lineno, text in _code_mentions(path, ("xla_cpu", "cpu_dots")):
            offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {text}")
    assert offenders == [], f"{len(offenders)} mentions of CPU tuning outside a CPU implementation:\n" + "\n".join(
        offenders)


def test_the_code_mention_finder_skips_prose(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Named in xla_cpu.py."""\n# xla_cpu.py too\nx = 1\n')
    assert list(_code_mentions(f, ("xla_cpu",))) == []
    f.write_text('import longctx.xla_cpu as h\nname = "xla_cpu"\nh.xla_cpu_rowdot()\n')
    assert [n for n, _ in _code_mentions(f, ("xla_cpu",))] == [1, 2, 3]


def _references():
    for path in _python_files():
        if path.name == "reference.py" or (path.parent.name == "pallas_kernels" and path.name.endswith("_ref.py")):
            yield path


def test_references_have_no_platform_branches_or_precision_overrides():
    """A reference is the paper's math: no backend query, no platform branch, no precision override, no CPU
    implementation imported."""
    refs = list(_references())
    offenders = []
    for path in refs:
        text = path.read_text()
        for word in ("default_backend", "platform_dependent", "Precision.HIGHEST", "xla_cpu", "cpu_dots"):
            for lineno, line in enumerate(text.splitlines(), 1):
                if word in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {word}")
    assert offenders == [], "platform tuning inside a reference:\n" + "\n".join(offenders)


def test_every_method_has_a_reference_file():
    missing = []
    for name in attention.names():
        module = attention._METHODS[name].split(":")[0]
        folder = ROOT / module.replace(".", "/")
        if not (folder / "reference.py").exists():
            missing.append(f"{name}: {folder.relative_to(ROOT)}/reference.py")
    assert missing == [], "methods without a reference file:\n" + "\n".join(missing)


def test_blocks_ask_capabilities_not_config_keys():
    for rel in ("longctx/models/gau.py", "longctx/models/blocks.py", "longctx/bench/dropin.py",
                "longctx/bench/capture.py", "longctx/bench/attention_bench.py"):
        text = (ROOT / rel).read_text()
        for key in ("qk_norm", "rel_dim", "transformer_vq", "W_R", "c_sum"):
            assert key not in text, f"{rel} reaches into a method's config or fields ({key})"


def test_kernels_never_import_longctx_and_load_without_it():
    for path in (ROOT / "pallas_kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "longctx" for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "longctx", path
    mods = [p.stem for p in (ROOT / "pallas_kernels").glob("*.py") if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import pallas_kernels.{m}\n" for m in mods)
            + "bad = [m for m in sys.modules if m.split('.')[0] == 'longctx']\nprint('LOADED', bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "LOADED []" in r.stdout, r.stdout + r.stderr[-2000:]
