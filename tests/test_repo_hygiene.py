"""Repository hygiene: the tree says what is true now and stands alone.

* no work-log numbering ("session" or "issue" followed by a number) in a tracked text file, CHANGELOG.md aside;
* no code comment or docstring in the library, kernels, configs or scripts quotes a timing (``12 ms``, ``3.5 s``,
  ``x1.23``) unless the command that produced it is on that line or within the three lines above;
* no reference to notes outside the repository (the team's method specs, "design" cards);
* a LICENSE, and one page per attention method under docs/methods/.

Runs on the files git knows about (tracked, plus untracked files that are not ignored); skipped without git.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("dense", "eva", "transformer_vq", "kdeformer", "fma", "vcc")

WORKLOG = re.compile(r"\b(?:session|issue) [0-9]+", re.IGNORECASE)
# written in two pieces so that this file does not match itself
OUTSIDE_REFS = re.compile("shared" + r"/specs|design" + r"\s+card", re.IGNORECASE)
TIMING = re.compile(
    r"(?<!every )(?<![\w.])\d+(?:[.,]\d+)*\s?(?:ns|µs|us|ms|s|sec|seconds|min|minutes)\b"  # 12 ms, 3.5 s, 4 min
    r"|(?<![\w.])x\d+\.\d+\b"  # x1.23-style speedups
    r"|(?<![\w.])\d+(?:\.\d+)?\s?x\s(?:faster|slower)\b"  # 2x slower
    r"|(?<![\w.])[-+−]\d+(?:\.\d+)?\s?%"  # a measured change: -9 %
    r"|(?<![\w.])\d+(?:\.\d+)?\s?%\s(?:faster|slower)\b"  # 10 % faster
)
COMMAND = re.compile(r"longctx-|scripts/|python -m")
TIMING_DIRS = ("longctx", "pallas_kernels", "configs", "scripts")


def _git_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the hygiene checks read `git ls-files`")
    out = []
    for args in (["ls-files"], ["ls-files", "--others", "--exclude-standard"]):
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"git ls-files failed: {r.stderr.strip()}")
        out += r.stdout.splitlines()
    return sorted({f for f in out if (ROOT / f).is_file()})


def _text(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    files = {}
    for f in _git_files():
        t = _text(f)
        if t is not None:
            files[f] = t
    return files


def _hits(texts: dict[str, str], pattern: re.Pattern, skip=()) -> list[str]:
    hits = []
    for f, t in texts.items():
        if f in skip:
            continue
        for i, line in enumerate(t.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{f}:{i}: {line.strip()[:160]}")
    return hits


def test_no_worklog_numbering(texts):
    hits = _hits(texts, WORKLOG, skip=("CHANGELOG.md",))
    assert not hits, "work-log numbering outside CHANGELOG.md:\n" + "\n".join(hits)


def test_no_references_outside_the_repository(texts):
    hits = _hits(texts, OUTSIDE_REFS)
    assert not hits, "references to notes outside the repository (cite docs/methods/<method>.md):\n" + "\n".join(hits)


def _python_prose(src: str) -> dict[int, str]:
    """{line number: its comment or docstring text} for the lines of ``src`` that hold one."""
    prose: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                prose[tok.start[0]] = tok.string
        tree = ast.parse(src)
    except (SyntaxError, tokenize.TokenError):
        return prose
    lines = src.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for i in range(first.lineno, first.end_lineno + 1):
                    prose[i] = lines[i - 1]
    return prose


def _shell_prose(src: str) -> dict[int, str]:
    return {i: line[line.index("#"):] for i, line in enumerate(src.splitlines(), 1)
            if "#" in line and not line.startswith("#!")}


def timing_hits(path: str, src: str) -> list[str]:
    """Comment / docstring lines of ``src`` that quote a timing with no command on the line or the 3 above."""
    if path.endswith(".py"):
        prose = _python_prose(src)
    elif path.endswith(".sh"):
        prose = _shell_prose(src)
    else:
        return []
    lines = src.splitlines()
    hits = []
    for i, text in sorted(prose.items()):
        if TIMING.search(text) and not any(COMMAND.search(lines[j]) for j in range(max(0, i - 4), i)):
            hits.append(f"{path}:{i}: {lines[i - 1].strip()[:160]}")
    return hits


def test_timing_detector():
    src = '"""Doc.\n\nThe loop takes 12 ms here.\n"""\nx = 1  # 3.5 s on CPU\ny = "20 ms"  # not a comment timing\n'
    assert [h.split(":")[1] for h in timing_hits("m.py", src)] == ["3", "5"]
    ok = '# measured with `longctx-bench attention --methods dense`:\n# 12 ms per call, x1.25 over the loop\n'
    assert timing_hits("m.py", ok) == []
    assert timing_hits("m.py", "# 1.7x the memory; 8 heads; 64 steps; W % P == 0\n") == []
    assert len(timing_hits("m.py", "# fwd+bwd 8k -9 %, 2x slower\n")) == 1
    assert len(timing_hits("s.sh", "echo hi  # about 40 min\n")) == 1


def test_no_timings_without_their_command(texts):
    hits = []
    for f, t in texts.items():
        if f.split("/")[0] in TIMING_DIRS:
            hits += timing_hits(f, t)
    assert not hits, ("comments quoting a timing without the command that measured it (give the reason in words, "
                      "or the command):\n" + "\n".join(hits))


def test_license_and_method_pages():
    assert (ROOT / "LICENSE").is_file() and "Apache License" in (ROOT / "LICENSE").read_text()
    missing = [m for m in METHODS if not (ROOT / "docs" / "methods" / f"{m}.md").is_file()]
    assert not missing, f"docs/methods/ lacks {missing}"


def test_every_listed_slow_case_names_a_test_that_exists():
    """``tests/slow_cases.txt`` (the cases the default run leaves to ``-m slow``) names tests by node id: a renamed or
    removed test would silently drop out of the list's effect, so each entry's file must define its function."""
    from tests.slow_cases import read_list

    defined = {m for p in (ROOT / "tests").rglob("*.py")  # a test class may inherit its tests from a base class
               for m in re.findall(r"^\s*def (test\w*)\(", p.read_text(), re.M)}
    stale = []
    for nodeid in sorted(read_list()):
        path, _, rest = nodeid.partition("::")
        func = rest.split("[", 1)[0].split("::")[-1]
        if not (ROOT / path).is_file() or func not in defined:
            stale.append(nodeid)
    assert not stale, "tests/slow_cases.txt names tests that no longer exist (regenerate it: tests/slow_cases.py): " \
        + ", ".join(stale[:5])
