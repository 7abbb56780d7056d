"""Each method is one room: no method name outside its own file, the registry, configs and
tests; kernels never import the package that uses them (no import cycle)."""

import ast
import subprocess
import sys
from pathlib import Path

from longctx import attention

ROOT = Path(__file__).resolve().parents[1]


def _string_literals(path: Path):
    tree = ast.parse(path.read_text())
    doc_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                doc_nodes.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in doc_nodes:
            yield node.lineno, node.value


def test_no_method_name_outside_its_room():
    rooms = {}
    for name in attention.names():
        module = attention._METHODS[name].split(":")[0]
        rooms[name] = ROOT / (module.replace(".", "/") + ".py")
    offenders = []
    for path in sorted((ROOT / "longctx").rglob("*.py")):
        if path in (ROOT / "longctx/attention/__init__.py", ROOT / "longctx/config.py"):  # registry, base config
            continue
        for lineno, text in _string_literals(path):
            for name, room in rooms.items():
                if path != room and text == name:
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {text!r}")
    assert offenders == [], "method names outside their rooms (ask a capability instead):\n" + "\n".join(offenders)


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
