"""Every bad input is answered with one line (what is wrong, what is allowed), exit status 2 and
no traceback: config values of every method and block, the flags of every command, prompts the
tokenizer cannot encode, missing / empty / truncated data files, a workdir holding another run.

``docs/errors.md`` is generated from these cases (the messages as the commands print them):

    .venv/bin/python -m tests.test_bad_inputs > docs/errors.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    cmd: str  # train | prepare | eval | sample | bench
    args: tuple[str, ...]  # {cfg} tiny config file, {run} trained workdir, {tmp} scratch folder, {other} a copy of {run}
    expect: str  # regex the one error line must match


T = ("--config={cfg}", "--workdir={tmp}/w")  # a valid tiny training command, to which a case adds one bad value
CASES = [
    # config flags and values (longctx-train), every block and method
    Case("unknown config key", "train", (*T, "--config.train.stepz=3"), r"unknown config key 'train.stepz'.*steps"),
    Case("value of the wrong type", "train", (*T, "--config.train.steps=abc"), r"train.steps"),
    Case("missing config file", "train", ("--config={tmp}/nope.py", "--workdir={tmp}/w"), r"cannot load the config file"),
    Case("no --workdir", "train", ("--config={cfg}",), r"--workdir is required"),
    Case("unknown flag", "train", (*T, "--stepz=3"), r"unknown flag --stepz.*allowed"),
    Case("stray argument", "train", (*T, "extra"), r"unexpected argument 'extra'"),
    Case("--max_steps=0", "train", (*T, "--max_steps=0"), r"max_steps=0 must be a positive"),
    Case("window does not divide seq_len", "train", (*T, "--config.train.window=24"), r"window=24 must divide"),
    Case("steps not a multiple of windows", "train", (*T, "--config.train.window=16", "--config.train.steps=7"),
         r"multiple of seq_len/window"),
    Case("unknown attention method", "train", (*T, "--config.model.attention.name=flash"), r"allowed: .*dense"),
    Case("unknown block", "train", (*T, "--config.model.block=mamba"), r"allowed: .*transformer"),
    Case("unknown positions", "train", (*T, "--config.model.positions=alibi"), r"choose one of"),
    Case("dropout out of range", "train", (*T, "--config.model.dropout=1.5"), r"\[0, 1\)"),
    Case("gau_layerdrop out of range", "train", (*T, "--config.model.block=gau", "--config.model.gau_layerdrop=1.0"),
         r"gau_layerdrop=1.0 must be in \[0, 1\)"),
    Case("odd head_dim with rotary", "train", (*T, "--config.model.head_dim=15"), r"even model.head_dim"),
    Case("adaptive softmax with tied embeddings", "train", (*T, "--config.model.output=adaptive"),
         r"tie_embeddings=False"),
    Case("dense: unknown option", "train", (*T, "--config.model.attention.dense.flash=true"), r"unknown config key"),
    Case("transformer_vq: bad codebook size", "train",
         (*T, "--config.model.block=gau", "--config.model.positions=none", "--config.model.num_heads=1",
          "--config.model.attention.name=transformer_vq", "--config.model.attention.transformer_vq.codebook_size=0"),
         r"codebook_size"),
    Case("eva: bad option", "train", (*T, "--config.model.attention.name=eva", "--config.model.attention.eva.chunk_size=0"),
         r"chunk_size"),
    Case("negative learning rate", "train", (*T, "--config.train.lr=-1"), r"train.lr=-1.0 must be positive"),
    Case("warm-up longer than the run", "train", (*T, "--config.train.warmup_steps=100"), r"warmup_steps=100 must be in"),
    Case("stride longer than context", "train", (*T, "--config.eval.stride=1000"), r"at most eval.context"),
    Case("mesh axis below 1", "train", (*T, "--config.mesh.tensor=0"), r"mesh.tensor=0 must be >= 1"),
    Case("unknown sequence mode", "train", (*T, "--config.mesh.sequence_mode=ring"),
         r"mesh.sequence_mode='ring'; allowed: auto, compose, xla"),
    Case("composed states for an encoder", "train",
         (*T, "--config.model.kind=encoder", "--config.model.causal=false", "--config.mesh.sequence_mode=compose"),
         r"an encoder has none"),
    Case("unknown data source", "train", (*T, "--config.data.source=imagenet"), r"allowed"),
    Case("unknown tokenizer", "train", (*T, "--config.data.tokenizer=chars"), r"allowed"),
    # data files
    Case("enwik8 file missing", "train", (*T, "--config.data.source=enwik8", "--config.data.path={tmp}/missing.zip"),
         r"enwik8: .*does not exist"),
    Case("enwik8 file empty", "train", (*T, "--config.data.source=enwik8", "--config.data.path={tmp}/empty/enwik8.zip"),
         r"enwik8: .*0 bytes, expected"),
    Case("enwik8 zip truncated", "train", (*T, "--config.data.source=enwik8", "--config.data.options.verify=false",
                                           "--config.data.path={tmp}/truncated/enwik8.zip"), r"corrupt or truncated"),
    Case("built-in corpus folder without .py files", "train", (*T, "--config.data.path={tmp}/nofiles"), r"no .py files"),
    Case("pg19 metadata.csv with a bad row", "train",
         (*T, "--config.data.source=pg19", "--config.data.tokenizer=bytes", "--config.data.path={tmp}/pg19"),
         r"metadata.csv line 1 has 2 fields"),
    Case("pg19 metadata.csv not UTF-8", "train",
         (*T, "--config.data.source=pg19", "--config.data.tokenizer=bytes", "--config.data.path={tmp}/pg19latin1"),
         r"pg19: .*metadata.csv is not valid UTF-8 .*copy it again"),
    Case("wikitext103 folder without its files", "train",
         (*T, "--config.data.source=wikitext103", "--config.data.tokenizer=words", "--config.data.path={tmp}/nofiles"),
         r"wikitext103: missing"),
    Case("workdir holds another run", "train", ("--config={cfg}", "--workdir={other}", "--config.model.d_model=64"),
         r"workdir holds a run with a different model config"),
    # longctx-prepare
    Case("prepare: unknown flag", "prepare", ("--config={cfg}", "--split=test"), r"unknown flag --split"),
    Case("prepare: data file missing", "prepare", ("--config={cfg}", "--config.data.source=enwik8",
                                                   "--config.data.path={tmp}/missing.zip"), r"does not exist"),
    # longctx-eval
    Case("eval: workdir missing", "eval", ("--workdir={tmp}/none",), r"does not exist: train first"),
    Case("eval: workdir without checkpoints", "eval", ("--workdir={tmp}/nofiles",), r"no checkpoints .*train first"),
    Case("eval: unknown split", "eval", ("--workdir={run}", "--split=dev"), r"--split=dev: value should be one of <train\|valid\|test>"),
    Case("eval: unknown protocol", "eval", ("--workdir={run}", "--config.eval.protocol=best"), r"choose one of"),
    Case("eval: changing the model", "eval", ("--workdir={run}", "--config.model.d_model=8"), r"allowed here"),
    Case("eval: a config file", "eval", ("--workdir={run}", "--config=configs/default.py"),
         r"reads the config saved in --workdir"),
    Case("eval: checkpoint step not there", "eval", ("--workdir={run}", "--step=999"), r"step 999 not found"),
    Case("eval: unknown flag", "eval", ("--workdir={run}", "--set=eval.protocol=sliding"), r"unknown flag --set"),
    # longctx-sample
    Case("sample: negative temperature", "sample", ("--workdir={run}", "--temperature=-1"), r"temperature=-1.0 must be >= 0"),
    Case("sample: zero tokens", "sample", ("--workdir={run}", "--num_tokens=0"), r"num_tokens=0 must be a positive"),
    Case("sample: top_p above 1", "sample", ("--workdir={run}", "--top_p=1.5"), r"top_p=1.5 must be in \(0, 1\]"),
    Case("sample: temperature not a number", "sample", ("--workdir={run}", "--temperature=hot"), r"temperature"),
    Case("sample: empty prompt", "sample", ("--workdir={run}", "--prompt="), r"prompt is empty"),
    Case("sample: prompt the tokenizer cannot encode", "sample", ("--workdir={run}", "--prompt=\udcff"),
         r"cannot be encoded by the 'bytes' tokenizer"),
    Case("sample: prompt file missing", "sample", ("--workdir={run}", "--prompt_file={tmp}/none.txt"),
         r"cannot read --prompt_file"),
    Case("sample: prompt file not UTF-8", "sample", ("--workdir={run}", "--prompt_file={tmp}/latin1.txt"),
         r"is not UTF-8"),
    Case("sample: --prompt and --prompt_file", "sample", ("--workdir={run}", "--prompt=a", "--prompt_file={tmp}/a.txt"),
         r"not both"),
    Case("sample: output exists", "sample", ("--workdir={run}", "--output={tmp}/a.txt"), r"never overwritten"),
    Case("sample: flags disagree", "sample", ("--workdir={run}", "--seed=1", "--config.sample.seed=2"), r"disagree"),
    # longctx-bench
    Case("bench: unknown sub-command", "bench", ("speed",), r"invalid choice: 'speed'"),
    Case("bench: unknown flag", "bench", ("report", "--fast"), r"unrecognized arguments: --fast"),
]


def make_context(root: Path) -> dict:
    """A trained tiny run and the bad files the cases point at."""
    from tests.conftest import tiny_config, write_corpus

    cfg = tiny_config(write_corpus(root / "corpus"), root / "cache", steps=2, warmup_steps=1, eval_every=100)
    cfg_file = root / "tiny.py"
    cfg_file.write_text(f"import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    from longctx.train.loop import train

    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, root / "run", progress=False)
    shutil.copytree(root / "run", root / "other")
    tmp = root / "tmp"
    for d in ("nofiles", "empty", "truncated", *(f"{p}/{s}" for p in ("pg19", "pg19latin1")
                                                  for s in ("train", "validation", "test"))):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    (tmp / "empty" / "enwik8.zip").write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(tmp / "full.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", bytes(range(256)) * 400)
    (tmp / "truncated" / "enwik8.zip").write_bytes((tmp / "full.zip").read_bytes()[:300])
    (tmp / "pg19" / "metadata.csv").write_text("123,Title\n")
    (tmp / "pg19latin1" / "metadata.csv").write_bytes("123,Caf\xe9 au lait,1900,http://x\n".encode("latin-1"))
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "a.txt").write_text("a")
    return {"cfg": str(cfg_file), "run": str(root / "run"), "other": str(root / "other"), "tmp": str(tmp)}


def run_case(case: Case, ctx: dict) -> tuple[int, str]:
    from longctx import cli
    from longctx.bench import cli as bench_cli

    entry = {"train": cli.train_main, "prepare": cli.prepare_main, "eval": cli.eval_main, "sample": cli.sample_main}
    args = [a.format(**ctx) for a in case.args]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = bench_cli.main(args) if case.cmd == "bench" else entry[case.cmd]([f"longctx-{case.cmd}", *args])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def error_line(stderr: str) -> str | None:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return lines[0] if len(lines) == 1 and "Traceback" not in stderr else None


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return make_context(tmp_path_factory.mktemp("bad_inputs"))


def test_at_least_30_distinct_cases():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert {c.cmd for c in CASES} == {"train", "prepare", "eval", "sample", "bench"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, ctx):
    code, err = run_case(case, ctx)
    line = error_line(err)
    assert code == 2 and line is not None, (code, err[-3000:])
    assert re.search(case.expect, line), line
    if case.cmd == "sample":
        assert not (Path(ctx["run"]) / "samples").exists()  # nothing written
    # the docs/errors.md row is the one generated from this message (no row edited by hand)
    row = doc_row(case, err, ctx)
    doc = (ROOT / "docs" / "errors.md").read_text().splitlines()
    assert row in doc, f"regenerate docs/errors.md (python -m tests.test_bad_inputs > docs/errors.md): {row}"


def test_errors_doc_lists_every_case():
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [c.id for c in CASES if f"| {c.id} |" not in doc]
    assert not missing, f"regenerate docs/errors.md (python -m tests.test_bad_inputs > docs/errors.md): {missing}"


PLACEHOLDERS = {"cfg": "tiny.py", "run": "runs/tiny", "other": "runs/tiny", "tmp": "/tmp/x"}


def command_line(case: Case) -> str:
    placeholders = PLACEHOLDERS
    args = " ".join(a.format(**placeholders).replace("\udcff", "\\xff") for a in case.args)
    return f"longctx-{case.cmd} {args}".replace("|", "\\|")


def doc_row(case: Case, stderr: str, ctx: dict) -> str:
    line = (error_line(stderr) or "(no single error line)").removeprefix("error: ")
    for key, value in ctx.items():
        line = line.replace(str(Path(value).resolve()), PLACEHOLDERS[key]).replace(value, PLACEHOLDERS[key])
    return f"| {case.id} | `{command_line(case)}` | {line.replace('|', '/')} |"


def generate_doc() -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ctx = make_context(Path(d))
        rows = []
        for case in CASES:
            _, err = run_case(case, ctx)
            rows.append(doc_row(case, err, ctx))
    head = ("# Errors\n\nEvery bad input is answered with one line on stderr (`error: ...`, what is wrong and what is\n"
            "allowed) and exit status 2, never a traceback. This table is generated from the cases of\n"
            "`tests/test_bad_inputs.py` (`.venv/bin/python -m tests.test_bad_inputs > docs/errors.md`), which\n"
            "checks each of them. `tiny.py` is a tiny config, `runs/tiny` a trained run, `/tmp/x` a folder of\n"
            "bad files (an empty or truncated `enwik8.zip`, a `metadata.csv` with a bad row or in Latin-1, a\n"
            "Latin-1 prompt).\n\n"
            "| case | command | message |\n|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(generate_doc())
