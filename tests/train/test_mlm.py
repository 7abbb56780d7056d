"""Encoders through the trainer and the commands: masked-LM training resumes exactly (in process
and after SIGTERM through the CLI), evaluation is one fixed masking of the split, longctx-fill fills
only the masked bytes, and the encoder's configuration errors are one line."""

import json
import re
import runpy
import signal
import time
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from longctx import cli
from longctx import config as config_lib
from longctx.errors import ConfigError
from tests.train.test_resume import run, train_losses, write_cfg

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("dense", "eva", "fma", "fma_linear", "kdeformer", "transformer_vq")


def mlm_tiny(method, corpus, cache, **train):
    c = runpy.run_path(str(ROOT / "configs" / "builtin" / f"mlm_{method}.py"))["get_config"]("tiny")
    c.data.source = "builtin"
    c.data.path = str(corpus)
    c.data.cache_dir = str(cache)
    c.train.async_checkpoints = False
    for k, v in train.items():
        c.train[k] = v
    return ml_collections.ConfigDict(c.to_dict())


@pytest.mark.slow
def test_resume_in_process_matches_uninterrupted(tiny_corpus, tmp_path):
    from longctx.train.loop import train

    cfg = mlm_tiny("dense", tiny_corpus, tmp_path / "cache", steps=6, ckpt_every=3, eval_every=6)
    train(cfg, tmp_path / "ref", progress=False)
    train(cfg, tmp_path / "run", progress=False, max_steps=3)
    assert max(train_losses(tmp_path / "run")) == 3
    train(cfg, tmp_path / "run", progress=False)
    ref, resumed = train_losses(tmp_path / "ref"), train_losses(tmp_path / "run")
    assert sorted(resumed) == list(range(1, 7))
    np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)], [ref[s] for s in (4, 5, 6)], rtol=1e-6)
    assert ref[6] != ref[5]  # the losses move: the comparison above is not between constants

    # evaluation: masked-token loss, accuracy, the protocol; the same numbers for any eval batch size
    outs = []
    for bs in (4, 3):
        assert cli.eval_main(["x", f"--workdir={tmp_path / 'run'}", "--split=valid", "--noprogress",
                              f"--config.eval.batch_size={bs}"]) == 0
        outs.append(json.loads(next((tmp_path / "run" / "eval").glob("valid_step6_*.json")).read_text()))
    a, b = outs
    assert a["protocol"]["mode"] == "masked-token" and a["protocol"]["masking"] == "bert"
    assert a["tokens_scored"] == a["protocol"]["rows"] * a["protocol"]["masked_per_row"] > 0
    assert 0.0 <= a["accuracy"] <= 1.0 and "bits_per_byte" in a
    assert a["nll_sum_nats"] == pytest.approx(b["nll_sum_nats"], rel=1e-5) and a["accuracy"] == b["accuracy"]

    # longctx-fill: the masked bytes change, every other byte stays
    text = "def value(self):\\n    return ____ + x\\n"
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.fill_main(["x", f"--workdir={tmp_path / 'run'}", f"--text={text}", "--noprogress"]) == 0
    filled = out.getvalue()[:-1]  # print's newline
    want = text.replace("\\n", "\n")
    assert len(filled) == len(want)
    keep = [i for i, ch in enumerate(want) if ch != "_"]
    assert [filled[i] for i in keep] == [want[i] for i in keep]
    # the filled bytes are named on stderr, escaped (a filled space or newline shows)
    assert re.search(r"; filled 28:32 ['\"].{4,16}['\"]\)$", err.getvalue().strip()), err.getvalue()


@pytest.mark.slow
def test_fill_refuses_a_decoder(tiny_cfg, tmp_path, capsys):
    from longctx.train.loop import train

    tiny_cfg.train.steps = 2
    tiny_cfg.train.warmup_steps = 1
    train(tiny_cfg, tmp_path / "dec", progress=False)
    with pytest.raises(SystemExit) as e:
        cli.fill_main(["x", f"--workdir={tmp_path / 'dec'}", "--text=a_b", "--noprogress"])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "needs an encoder run" in err[0]


def test_encoder_config_errors_are_one_line(tiny_corpus, tmp_path):
    cfg = mlm_tiny("dense", tiny_corpus, tmp_path / "cache")
    cfg.train.window = 32
    with pytest.raises(ConfigError, match="windows do not apply to encoders"):
        config_lib.validate(cfg)
    for key, val, msg in (("masking", "random", "mlm.masking='random' is not allowed"),
                          ("rate", 0.0, "mlm.rate=0.0 must be in"), ("mask_prob", 0.95, "sum of at most 1"),
                          ("clusters", (5, 2), "mlm.clusters")):
        cfg = mlm_tiny("dense", tiny_corpus, tmp_path / "cache")
        cfg.mlm[key] = val
        with pytest.raises(ConfigError, match=msg):
            config_lib.validate(cfg)
    cfg = mlm_tiny("dense", tiny_corpus, tmp_path / "cache")
    cfg.model.causal = True  # an encoder's blocks are bidirectional whatever model.causal says
    assert config_lib.validate(cfg).model.causal is False
    resolved = config_lib.resolve_vocab(config_lib.validate(cfg), 256)
    assert (resolved.mlm.mask_id, resolved.model.vocab_size) == (256, 257)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_cli_sigterm_then_resume_matches_uninterrupted(method, tiny_corpus, tmp_path):
    """Every bidirectional method's tiny encoder trains through longctx-train, stops on SIGTERM with a
    checkpoint, resumes to the uninterrupted run's losses, and evaluates through longctx-eval."""
    steps = 30
    cfg = mlm_tiny(method, tiny_corpus, tmp_path / "cache", steps=steps, ckpt_every=1000, eval_every=1000)
    cfg_file = write_cfg(tmp_path / "cfg.py", cfg)
    ref = run(cfg_file, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = train_losses(tmp_path / "ref")

    proc = run(cfg_file, tmp_path / "run", wait=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped_at = max(train_losses(tmp_path / "run"))
    assert 5 <= stopped_at < steps, stopped_at
    again = run(cfg_file, tmp_path / "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint at step {stopped_at}" in again.stdout
    resumed = train_losses(tmp_path / "run")
    after = list(range(stopped_at + 1, steps + 1))
    np.testing.assert_allclose([resumed[s] for s in after], [ref_losses[s] for s in after], rtol=1e-6)
    assert cli.eval_main(["x", f"--workdir={tmp_path / 'run'}", "--split=test", "--noprogress"]) == 0
    res = json.loads(next((tmp_path / "run" / "eval").glob(f"test_step{steps}_*.json")).read_text())
    assert res["protocol"]["mode"] == "masked-token" and np.isfinite(res["bits_per_byte"])
