"""``longctx-bench dropin`` on the imported tiny Llama-style fixture: KDEformer in every layer, no training; the
per-layer error against exact attention and the bits per byte before and after the swap (longctx/bench/dropin.py).
The fixture's tokenizer knows the words w2 ... w127, so the text here is made of them (real English maps to its
<unk> almost everywhere, and attention over identical values is exact for any weighting)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from longctx.bench.cli import main as bench
from longctx.convert import core

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama_tiny"
SMALL = [f"--config.model.attention.kdeformer.causal.{k}={v}"
         for k, v in (("chunk_size", 16), ("local_chunks", 1), ("heavy_capacity", 8), ("num_samples", 16))]


@pytest.fixture(scope="module")
def run_and_text(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropin")
    core.import_hf(FIXTURE, tmp / "run", optimizer_state=False, log=lambda *_: None)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(2, 128)]
    (tmp / "words.txt").write_text(" ".join(words[i] for i in rng.integers(0, len(words), 600)) + "\n")
    return tmp / "run", tmp / "words.txt"


def _dropin(out: Path, run: Path, text: Path, *extra) -> dict:
    assert bench(["dropin", f"--workdir={run}", f"--text={text}", "--rows=2", "--seq_len=64", f"--out={out}",
                  "--noprogress", *extra]) == 0
    assert (out / "dropin.md").is_file()
    return json.loads((out / "dropin.json").read_text())


def test_kdeformer_dropin_reports_each_layers_error_and_bits_per_byte(run_and_text, tmp_path):
    run, text = run_and_text
    res = _dropin(tmp_path / "kde", run, text, "--method=kdeformer", *SMALL)
    assert [r["layer"] for r in res["layers"]] == [0, 1]
    # beyond the exact window (one chunk of 16 tokens) KDEformer estimates: an error, finite and below 100 %
    assert all(0.01 < r["rel_error"] < 1.5 for r in res["layers"]), res["layers"]
    assert res["bytes_scored"] > res["tokens_scored"] > 0  # words of 2-4 characters and a space each
    for k in ("bits_per_byte_exact", "bits_per_byte_dropin"):
        assert math.isfinite(res[k]) and res[k] > 0
    assert res["bits_per_byte_dropin"] != res["bits_per_byte_exact"]
    # exact attention dropped in: no error, the same bits per byte
    same = _dropin(tmp_path / "dense", run, text, "--method=dense")
    assert all(r["rel_error"] == 0.0 for r in same["layers"])
    assert same["bits_per_byte_dropin"] == same["bits_per_byte_exact"] == res["bits_per_byte_exact"]


def test_dropin_refusals(run_and_text, tmp_path, capsys):
    run, text = run_and_text
    for args, msg in ((["--method=nope"], "registered"), (["--method=kdeformer", "--config.train.lr=1"], "only the method's own settings")):
        with pytest.raises(SystemExit) as e:
            bench(["dropin", f"--workdir={run}", f"--text={text}", f"--out={tmp_path}", *args])
        assert e.value.code == 2 and msg in capsys.readouterr().err
