"""End to end through the entry points: train a tiny config, evaluate, sample."""

import json

from longctx import cli
from longctx.train.loop import train


def test_train_eval_sample(tiny_cfg, tmp_path, capsys):
    wd = tmp_path / "run"
    summary = train(tiny_cfg, wd, progress=False)
    assert summary["step"] == 8
    assert (wd / "loss.png").exists() and (wd / "metrics.jsonl").exists() and (wd / "config.json").exists()
    assert list((wd / "tb").iterdir())
    assert cli.eval_main(["longctx-eval", "--workdir", str(wd), "--split", "test"]) == 0
    res = json.loads((wd / "eval" / "test_step8_stream-w32-document32-n512.json").read_text())
    assert res["tokens_scored"] == 512 and res["protocol"]["mode"] == "stream-with-state"
    assert res["bits_per_byte"] < 8.0 and "gzip-9" in res["compressors_bits_per_byte"]
    assert (wd / "eval" / "test_step8_stream-w32-document32-n512_loss_vs_position.png").exists()
    bins = res["by_position"]  # the plot's log-spaced bins, each with its tokens: every scored token once
    assert bins[0]["lo"] == 1 and bins[-1]["hi"] == 32 and sum(b["tokens"] for b in bins) == 512
    assert all(a["hi"] < b["lo"] for a, b in zip(bins, bins[1:]))
    assert cli.eval_main(["longctx-eval", "--workdir", str(wd), "--config.eval.protocol=sliding",
                          "--config.eval.max_tokens=100", "--noprogress"]) == 0
    res = json.loads((wd / "eval" / "valid_step8_sliding-c32-s16-n100.json").read_text())
    assert res["tokens_scored"] == 100 and res["protocol"]["mode"] == "sliding-window"
    assert len(list((wd / "eval").glob("*.json"))) == 2  # another protocol: another file, none overwritten
    assert cli.sample_main(["longctx-sample", "--workdir", str(wd), "--prompt", "def f", "--num_tokens", "20", "--quiet"]) == 0
    rep = json.loads((wd / "samples" / "step8_seed0.json").read_text())
    assert rep["num_tokens"] == 20 and rep["tokens_per_sec"] > 0
    text = (wd / "samples" / "step8_seed0.txt").read_text()
    assert text.startswith("def f")
    # a second run never overwrites the first sample
    assert cli.sample_main(["longctx-sample", "--workdir", str(wd), "--prompt", "class", "--num_tokens", "5", "--quiet",
                        "--noprogress"]) == 0
    assert (wd / "samples" / "step8_seed0.txt").read_text() == text
    assert (wd / "samples" / "step8_seed0-2.txt").read_text().startswith("class")
    out = capsys.readouterr().out
    assert "bits per byte" in out
