"""Every ``longctx-*`` command written in the README, docs/*.md, docs/methods/*.md and the config
files' docstrings parses: its flags exist, its config loads with its variant, its overrides apply
and validate. Each runs in-process with ``--check`` (parse, load, validate, stop; nothing trains,
reads a run or touches data, so paths like /data/enwik8.zip need not exist). ``longctx-bench``
lines go through the bench's own ``parse_args`` when it has one.

docs/errors.md is left out: its table lists commands that fail on purpose (tests/test_bad_inputs.py
checks them)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_FILES = {"docs/errors.md"}  # commands that fail on purpose
PLACEHOLDER = re.compile(r"\.\.\.|…|<[A-Za-z_ ]+>|\[--?")  # `--config=...`, `<method>`, `[--task=...]`
_LINE = re.compile(r"^\s*(?:\$\s+)?(?:\S*/)?(longctx-[a-z-]+\b.*)$")
_INLINE = re.compile(r"``?(?:\S*/)?(longctx-[a-z-]+ [^`]*?--[^`]+?)``?")  # with a flag: a command, not a name


def sources() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md")),
             *sorted((ROOT / "configs").rglob("*.py"))]
    return [f for f in files if f.is_file() and f.relative_to(ROOT).as_posix() not in SKIP_FILES]


def docstrings(text: str) -> list[tuple[int, str]]:
    """(first line, text) of the module's and its functions' docstrings."""
    tree = ast.parse(text)
    out = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return list(dict.fromkeys(out))


def commands_in(text: str, *, first_line: int = 1) -> list[tuple[int, str]]:
    """(line number, command) for each ``longctx-*`` command in ``text``: lines that start with one
    (continued by a trailing backslash, a trailing ``# comment`` dropped) and inline code spans
    that hold one with a flag (`longctx-bench profile` alone names a command, not a call). Commands with placeholders (``...``, ``<x>``, ``[--opt]``) are left out."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _LINE.match(lines[i])
        if m:
            cmd, at = m.group(1), i
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            found.append((first_line + at, _drop_comment(cmd).rstrip("`").strip()))
        else:
            for span in _INLINE.finditer(lines[i]):
                found.append((first_line + i, span.group(1).strip()))
        i += 1
    return [(n, c) for n, c in found if not PLACEHOLDER.search(c)]


def _drop_comment(cmd: str) -> str:
    """``longctx-eval --split test   # context 480`` -> the command (a ``#`` inside quotes stays)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=False)
    lex.whitespace_split, lex.commenters = True, "#"
    try:
        return shlex.join(list(lex))
    except ValueError:
        return cmd


def collect() -> list[tuple[str, str]]:
    out = []
    for f in sources():
        rel = f.relative_to(ROOT).as_posix()
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".py":
            for line, doc in docstrings(text):
                out += [(f"{rel}:{n}", c) for n, c in commands_in(doc, first_line=line)]
        else:
            out += [(f"{rel}:{n}", c) for n, c in commands_in(text)]
    return out


def entry_points() -> dict:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target for name, target in scripts.items()}


def check(cmd: str) -> tuple[bool, str]:
    """Parse ``cmd`` as its entry point would, with ``--check``: (ok, what it printed)."""
    argv = shlex.split(cmd)
    prog = Path(argv[0]).name
    targets = entry_points()
    if prog not in targets:
        return False, f"no such command {prog!r}; the commands are {', '.join(sorted(targets))}"
    out, err = io.StringIO(), io.StringIO()
    ok = False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if prog == "longctx-bench":
                from longctx.bench import cli as bench_cli
                from longctx.errors import ConfigError

                try:
                    bench_cli.parse_args(argv[1:])
                    ok = True
                except ConfigError as e:
                    print(f"error: {e}", file=err)
            else:
                module, func = targets[prog].split(":")
                rc = getattr(importlib.import_module(module), func)([prog, *argv[1:], "--check"])
                ok = rc in (0, None)
        except SystemExit as e:
            ok = e.code in (0, None)
    return ok, (out.getvalue() + err.getvalue()).strip()


def bench_parses() -> bool:
    from longctx.bench import cli as bench_cli

    return hasattr(bench_cli, "parse_args")


COMMANDS = collect()


def test_the_docs_hold_commands():
    progs = {shlex.split(c)[0].rsplit("/", 1)[-1] for _, c in COMMANDS}
    assert {"longctx-train", "longctx-eval", "longctx-prepare"} <= progs, progs
    assert any(":tiny" in c for _, c in COMMANDS)


@pytest.mark.parametrize("where,cmd", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where, cmd):
    if cmd.split()[0].endswith("longctx-bench") and not bench_parses():
        pytest.skip("longctx-bench has no parse-only parse_args")
    ok, said = check(cmd)
    assert ok, f"{where}: {cmd}\n{said}"


BROKEN = '''"""A config whose docstring carries stale commands.

    longctx-train --config configs/default.py --workdir runs/x
    longctx-eval  --workdir runs/x --split test --set eval.max_tokens=100000
    longctx-train --config configs/default.py:huge --workdir runs/x
    longctx-train --config configs/default.py --config.train.stepz=3 --workdir runs/x
    longctx-train --config configs/nope.py --workdir runs/x
    longctx-eval  --workdir runs/x --config.model.d_model=64
    longctx-evaluate --workdir runs/x
"""
'''


def test_a_broken_docstring_fails():
    found = [c for _, doc in docstrings(BROKEN) for _, c in commands_in(doc)]
    assert len(found) == 7
    results = [check(c) for c in found]
    assert results[0][0], results[0][1]  # the one good command
    for cmd, (ok, said) in zip(found[1:], results[1:]):
        assert not ok, f"{cmd} passed: {said}"
    said = [s for _, s in results[1:]]
    assert "unknown flag --set" in said[0]
    assert "unknown variant 'huge'; allowed: tiny" in said[1]
    assert "did you mean 'steps'" in said[2]
    assert "configs/nope.py not found" in said[3]
    assert "allowed here: --config.eval.*" in said[4]
    assert "no such command 'longctx-evaluate'" in said[5]


def test_extraction_rules():
    text = """
    longctx-eval --workdir runs/a --split test              # context 480
    longctx-train --config=configs/default.py \\
        --workdir=runs/b
    Prose with `longctx-train --config=configs/main.py --workdir=r` inline, `longctx-eval` alone,
    and `longctx-train --config=... --dry_run` with a placeholder.
    .venv/bin/longctx-sample --workdir=runs/a --prompt="x # y"
    """
    assert [c for _, c in commands_in(text)] == [
        "longctx-eval --workdir runs/a --split test",
        "longctx-train --config=configs/default.py --workdir=runs/b",
        "longctx-train --config=configs/main.py --workdir=r",
        "longctx-sample --workdir=runs/a '--prompt=x # y'",
    ]
