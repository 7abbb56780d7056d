"""The package's modules import each other without circles: the graph of every ``import`` of a ``longctx`` or
``pallas_kernels`` module, wherever it stands in a file (inside functions too: an import moved into a function
hides a circle, it does not remove it), has no strongly connected component of more than one module. A module's
import of its own package (``from longctx.attention.dense import platform`` inside ``dense/layer.py``) is the
package's structure, not an edge. A registry that imports by name (``attention._METHODS``, ``data.tokenizers``) is
not an edge either: that is what a registry is for.

Package imports stand at the module's top. One left inside a function says why on its own line, as a comment
``# deferred: <reason>`` (an import circle at load, or a console script's start-up measured without it);
:func:`test_every_function_level_import_says_why_it_is_deferred` lists those that do not.

    .venv/bin/python tests/test_import_graph.py     # the circles, if any, and every module's edges in them;
                                                    # then the deferred imports, counted by reason
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("longctx", "pallas_kernels")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its file)."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and t.startswith(PACKAGES) and not m.startswith(t + "."):
                    edges[m].add(t)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


DEFERRED = "# deferred:"


def _in_functions(node, in_function=False):
    """The Import/ImportFrom nodes under ``node`` that stand inside a function (methods and nested ones too)."""
    for child in ast.iter_child_nodes(node):
        if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _in_functions(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def function_level_imports(files=None) -> list[tuple[str, int, str | None]]:
    """(file, line, reason) of every import of a package module (``longctx``, ``pallas_kernels``, ``configs``)
    that stands inside a function; reason: the text after ``# deferred:`` on the statement's lines, else None."""
    if files is None:
        files = sorted(p for pkg in (*PACKAGES, "configs") for p in (ROOT / pkg).rglob("*.py"))
    out = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for node in _in_functions(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = ["." if node.level else (node.module or "")]
            if any(n == "." or n.split(".")[0] in (*PACKAGES, "configs") for n in names):
                said = " ".join(lines[node.lineno - 1:node.end_lineno])
                reason = said.split(DEFERRED, 1)[1].strip() if DEFERRED in said else None
                out.append((rel, node.lineno, reason or None))
    return out


def test_the_import_lister_reads_reasons(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom longctx import cli\n\n\ndef g():\n    import json\n"
                 "    from longctx import config  # deferred: a reason\n    from pallas_kernels import (\n"
                 "        precision,\n    )\n\n    class K:\n        def h(self):\n"
                 "            import configs.default\n")
    assert function_level_imports([f]) == [(str(f), 7, "a reason"), (str(f), 8, None), (str(f), 14, None)]


def test_every_function_level_import_says_why_it_is_deferred():
    found = function_level_imports()
    assert len(found) > 10  # the walk found the package's deferred imports
    unsaid = [f"{file}:{line}" for file, line, reason in found if reason is None]
    assert not unsaid, (f"package imports inside a function without a '{DEFERRED} <reason>' comment (move them to "
                        "the module's top, or say why not): " + ", ".join(unsaid))


def test_the_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    edges = import_graph()
    assert len(edges) > 100  # the walk found the package
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(edges[m] & set(c))}" for m in c) + ")" for c in found)


if __name__ == "__main__":
    g = import_graph()
    for c in circles(g):
        print(" <-> ".join(c))
        for m in c:
            print(f"    {m} -> {sorted(g[m] & set(c))}")
    groups: dict[str, Counter] = {}
    for file, _, reason in function_level_imports():
        label = reason or "NO REASON GIVEN"
        groups.setdefault(label, Counter())[file] += 1
    print(f"{sum(sum(c.values()) for c in groups.values())} package imports inside functions, by reason:")
    for label, files in sorted(groups.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {sum(files.values()):4d}  {label}")
        for file, n in sorted(files.items()):
            print(f"        {n:4d}  {file}")
    sys.exit(0)
