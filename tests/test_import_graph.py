"""The package's modules import each other without circles: the graph of every ``import`` of a ``longctx`` or
``pallas_kernels`` module, wherever it stands in a file (inside functions too: an import moved into a function
hides a circle, it does not remove it), has no strongly connected component of more than one module. A module's
import of its own package (``from longctx.attention.dense import platform`` inside ``dense/layer.py``) is the
package's structure, not an edge. A registry that imports by name (``attention._METHODS``, ``data.tokenizers``) is
not an edge either: that is what a registry is for.

    .venv/bin/python tests/test_import_graph.py     # the circles, if any, and every module's edges in them
"""

from __future__ import annotations

import ast
import sys
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
    sys.exit(0)
