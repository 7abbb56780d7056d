"""longctx-prepare: summary, idempotence, interrupted runs give the same files as clean ones."""

import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from longctx import cli
from longctx.data import sources
from longctx.data.prepare import cache_path, load_split, prepare, prepare_split

ROOT = Path(__file__).resolve().parents[2]


def enwik8_fixture(tmp_path, n=20000):
    rng = np.random.default_rng(0)
    data = rng.integers(32, 127, size=n, dtype=np.uint8).tobytes()
    f = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", data)
    return f, data


def enwik8_argv(path, cache):
    return ["longctx-prepare", "--config", str(ROOT / "configs/enwik8/dense.py") + ":tiny", f"--config.data.path={path}",
            f"--config.data.cache_dir={cache}", "--config.data.options.verify=False", "--noprogress"]


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_cli_prepares_all_splits_prints_summary_and_is_idempotent(tmp_path, capsys):
    f, data = enwik8_fixture(tmp_path)
    assert cli.prepare_main(enwik8_argv(f, tmp_path / "cache")) == 0
    out1 = capsys.readouterr().out
    dirs = list((tmp_path / "cache").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("enwik8-bytes-")
    d = dirs[0]
    for split, n in (("train", 18000), ("valid", 1000), ("test", 1000)):
        m = load_split(d, split, verify=True).manifest
        assert m["num_tokens"] == n
        assert f"{n:,} tokens" in out1 and m["sha256"] in out1
    assert str(d) in out1 and "vocabulary 256" in out1
    stamp = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert cli.prepare_main(enwik8_argv(f, tmp_path / "cache")) == 0
    assert capsys.readouterr().out == out1
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == stamp


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.prepare_main(["longctx-prepare", "--config", str(ROOT / "configs/enwik8/dense.py") + ":tiny",
                          f"--config.data.path={tmp_path}", "--noprogress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: enwik8: expected") and "mattmahoney.net" in err and err.count("\n") == 1


def test_source_failing_midway_then_rerun_equals_a_clean_run(tmp_path):
    f, _ = enwik8_fixture(tmp_path)
    import ml_collections

    from longctx.config import base_config

    c = base_config().data
    c.source, c.path, c.options.verify = "enwik8", str(f), False
    c.cache_dir = str(tmp_path / "broken")
    cfg = ml_collections.ConfigDict(c.to_dict())
    src = sources.build(cfg)
    meta = src.metadata()
    directory = cache_path(meta, "bytes", cfg.cache_dir, extra="{}")

    class Failing:
        def documents(self, split):
            yield "part", src.split_bytes(split)[:5000]
            raise RuntimeError("disk unplugged")

    from longctx.data.tokenizers import ByteTokenizer

    with pytest.raises(RuntimeError):
        prepare_split(Failing(), ByteTokenizer(), "train", directory, source_meta=meta, progress=False)
    assert not (directory / "train.json").exists()
    _, _, d_rerun = prepare(cfg, progress=False)
    assert d_rerun == directory
    cfg.cache_dir = str(tmp_path / "clean")
    _, _, d_clean = prepare(cfg, progress=False)
    assert d_clean.name == directory.name
    assert snapshot(d_rerun) == snapshot(d_clean)


def write_big_wikitext(root: Path, n_articles=1500, seed=0):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(3000)] + ["<unk>", "@-@", "@,@", ",", "."]
    root.mkdir(parents=True)

    def article(i):
        out = [" ", f" = Article {i} = ", " "]
        for j in range(30):
            if j % 10 == 0:
                out += [f" = = Section {j} = = ", " "]
            out.append(" " + " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 25))) + " ")
        return out

    for split, n in (("train", n_articles), ("valid", 5), ("test", 5)):
        lines = [ln for i in range(n) for ln in article(i)]
        (root / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")


def test_sigkill_while_writing_then_rerun_equals_a_clean_run(tmp_path, capsys):
    wt = tmp_path / "wt"
    write_big_wikitext(wt)
    cache = tmp_path / "killed"
    argv = ["--config", str(ROOT / "configs/wikitext103/dense.py") + ":tiny", f"--config.data.path={wt}",
            f"--config.data.cache_dir={cache}", "--noprogress"]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from longctx.cli import prepare_main; sys.exit(prepare_main())",
                             *argv], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tmp_file = None
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            found = list(cache.glob("*/.train.bin.tmp-*")) if cache.exists() else []
            if found:
                os.kill(proc.pid, signal.SIGKILL)
                tmp_file = found[0]
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None and tmp_file is None:
            proc.kill()
        proc.wait()
    assert tmp_file is not None, f"the run ended before it could be killed mid-write: {proc.stderr.read()[-500:]}"
    assert proc.returncode == -signal.SIGKILL
    directory = tmp_file.parent
    assert tmp_file.exists() and not (directory / "train.json").exists()  # killed while writing train.bin
    assert cli.prepare_main(["longctx-prepare", *argv]) == 0
    assert "removed 1 temporary file" in capsys.readouterr().out
    clean_argv = [a.replace(str(cache), str(tmp_path / "clean")) for a in argv]
    assert cli.prepare_main(["longctx-prepare", *clean_argv]) == 0
    clean = tmp_path / "clean" / directory.name
    assert snapshot(directory) == snapshot(clean)  # same names (no leftovers) and same bytes
    assert {"vocab.txt", "train.bin", "train.json", "test.json"} <= set(snapshot(clean))
