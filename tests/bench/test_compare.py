"""`longctx-bench compare`: its runs, their equal-FLOP steps, the report rebuilt from whatever finished (means and
spreads over seeds, missing runs named), and (slow) the whole command end to end at the smoke scale, resumed."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import pytest

from longctx.bench import cli, compare
from longctx.errors import ConfigError


def _args(tmp_path, *extra):
    return cli.parse_args(["compare", "--out", str(tmp_path / "cmp"), "--runs", str(tmp_path / "runs"), *extra])


@pytest.mark.parametrize("argv, message", [
    (["--methods", "nope"], "--methods 'nope'"),
    (["--contexts", "0"], "--contexts '0'"),
    (["--window", "-1"], "--window -1"),
    (["--seeds", "0"], "--seeds"),
    (["--contexts", "abc"], "--contexts 'abc'"),
    (["--readme", "/nonexistent/README.md"], "--readme=/nonexistent/README.md: no such file"),
])
def test_bad_flags_refused(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _args(tmp_path, *argv)


def test_runs_every_method_context_seed_and_one_hybrid_each(tmp_path):
    a = _args(tmp_path, "--methods", f"dense,{compare.WINDOW},eva", "--contexts", "128,256", "--seeds", "3")
    rs = compare.runs(a)
    pure = [r for r in rs if not r["hybrid"]]
    assert len(pure) == 3 * 2 * 3
    first = [i for i, r in enumerate(rs) if r["hybrid"]]  # the hybrids train after the second seed
    assert {r["seed"] for r in rs[:first[0]]} == {0, 1} and {r["seed"] for r in rs[first[-1] + 1:]} == {2}
    assert [r["label"] for r in rs if r["hybrid"]] == [f"hybrid_{compare.WINDOW}", "hybrid_eva"]  # none of exact
    assert all(r["context"] == 256 and r["seed"] == 0 for r in rs if r["hybrid"])
    assert len({r["dir"] for r in rs}) == len(rs)
    assert [r["seed"] for r in pure] == sorted(r["seed"] for r in pure)  # whole seeds first


def test_run_config_window_pattern_and_equal_tokens(tmp_path):
    W = compare.WINDOW
    a = _args(tmp_path, "--scale", "smoke", "--methods", f"{W},eva", "--contexts", "64,128", "--window", "32")
    rs = {(r["label"], r["context"]): r for r in compare.runs(a)}
    win = compare.run_config(rs[(W, 64)], a, steps=10)
    assert win.model.attention.name == W and win.model.attention[W].window == 32
    local_global = compare.run_config(rs[(f"hybrid_{W}", 128)], a, steps=10)
    assert tuple(local_global.model.attention.pattern)[-2:] == (W, "dense")
    assert local_global.model.attention[W].window == 32
    hyb = compare.run_config(rs[("hybrid_eva", 128)], a, steps=10)
    assert tuple(hyb.model.attention.pattern) == ("eva",) * (hyb.model.num_layers - 1) + ("dense",)
    short, long_ = compare.run_config(rs[("eva", 64)], a), compare.run_config(rs[("eva", 128)], a)
    assert short.train.batch_size * 64 == long_.train.batch_size * 128 == compare.SCALES["smoke"]["tokens_per_step"]


def test_steps_equal_flop_budget(tmp_path):
    a = _args(tmp_path, "--methods", "dense,eva", "--contexts", "256", "--dense_steps", "300")
    cost = {"dense_ctx256": {"flops_per_token": 2.0e6}, "eva_ctx256": {"flops_per_token": 3.0e6}}
    rs = {r["label"]: r for r in compare.runs(a)}
    assert compare.steps_for(rs["dense"], a, cost) == 300
    assert compare.steps_for(rs["eva"], a, cost) == 200  # 300 x 2/3: the same training FLOPs


def _finished(args, run: dict, valid: float, test: float) -> None:
    p = compare.result_path(args, run)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({
        **run, "steps": 10, "tokens_per_step": 512, "params": 1000, "train_wall_s": 60.0, "tokens_per_s": 100.0,
        "valid_bits_per_byte": valid, "test_bits_per_byte": test, "curve": [[5, valid + 1], [10, valid]],
        "test_by_position": [{"lo": 1, "hi": 1, "tokens": 4, "bits_per_token": test + 0.5},
                             {"lo": 2, "hi": 128, "tokens": 508, "bits_per_token": test}],
        "passkey": {"status": "ok", "accuracy": 0.0, "by_distance": [
            {"lo": 10, "hi": 60, "answers": 8, "accuracy": 0.0, "loss_nats_per_token": 2.0}]}}))


def test_report_from_what_finished(tmp_path):
    a = _args(tmp_path, "--methods", "dense,eva", "--contexts", "128", "--seeds", "3", "--nohybrids")
    rs = {(r["label"], r["seed"]): r for r in compare.runs(a)}
    dense_valid = [2.0, 2.2, 2.4]
    for s, v in enumerate(dense_valid):
        _finished(a, rs[("dense", s)], v, v + 0.1)
    _finished(a, rs[("eva", 1)], 2.5, 2.6)
    assert not Path(a.runs).exists()  # the report needs no checkpoints: a fresh clone rebuilds it
    res = compare.run(cli.parse_args(["compare", "--out", a.out, "--runs", a.runs, "--methods", "dense,eva", "--contexts", "128",
                                      "--seeds", "3", "--nohybrids", "--report_only"]))
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["dense"]["valid_bits_per_byte"] == pytest.approx(statistics.fmean(dense_valid))
    assert rows["dense"]["valid_bits_per_byte_sd"] == pytest.approx(statistics.stdev(dense_valid))
    assert rows["eva"]["seeds"] == [1] and rows["eva"]["valid_bits_per_byte_sd"] is None
    assert {(r["label"], r["seed"]) for r in res["missing"]} == {("eva", 0), ("eva", 2)}
    md = (Path(a.out) / "compare.md").read_text()
    assert "4 of 6 runs finished" in md and "`eva` ctx 128 seed 0" in md
    assert f"{statistics.fmean(dense_valid):.4f} ± {statistics.stdev(dense_valid):.4f} (3)" in md
    assert (Path(a.out) / "compare.png").is_file()


@pytest.mark.slow
def test_smoke_end_to_end_and_resume(tmp_path):
    argv = ["compare", "--scale", "smoke", "--methods", "dense,eva", "--seeds", "1", "--nohybrids",
            "--needle", "eva", "--out", str(tmp_path / "cmp"), "--runs", str(tmp_path / "runs")]
    res = compare.run(cli.parse_args(argv))
    assert not res["missing"] and {r["label"] for r in res["rows"]} == {"dense", "eva"}
    for r in res["results"]:
        assert 0 < r["valid_bits_per_byte"] < 9 and 0 < r["test_bits_per_byte"] < 9 and r["test_by_position"]
        assert r["curve"] and r["passkey"]["status"] in ("ok", "capacity")
    out = tmp_path / "cmp"
    assert list(out.glob("needle/eva/needle_grid_*.md")) and (out / "decode" / "decode.json").is_file()
    done = sorted(out.glob("results/*.json"))
    assert len(done) == 2 and not (out / "runs").exists() and (tmp_path / "runs").is_dir()
    stamps = [p.stat().st_mtime_ns for p in done]
    (done[0]).unlink()  # an unfinished run: scored again from its trained checkpoint, the other skipped
    compare.run(cli.parse_args(argv))
    assert done[0].is_file() and done[1].stat().st_mtime_ns == stamps[1]


def test_parameters_matched_to_the_exact_run(tmp_path):
    """Each method's feed-forward (GAU: value) width is chosen so its parameters outside the attention cores (the
    default) or all of them (``total``) are the exact run's within a width step; the cores' own parameters are
    counted apart (FMA's downsampling kernels: some; exact attention: none); ``none`` keeps each config's own
    widths (Transformer-VQ's GAUs then differ by far more)."""
    exact = None
    for rule, part in (("backbone", "backbone"), ("total", "all")):
        a = _args(tmp_path, "--scale", "smoke", "--methods", "dense,fma,transformer_vq", "--contexts", "128",
                  "--match_params", rule)
        rs = {r["label"]: r for r in compare.runs(a) if r["seed"] == 0}
        dense = compare.run_config(rs["dense"], a)
        exact = compare.param_count(dense, part)
        assert compare.param_count(dense, "core") == 0
        assert compare.param_count(dense, "all") == compare.param_count(dense, "backbone")
        for label in ("fma", "transformer_vq", "hybrid_fma"):
            cfg = compare.run_config(rs[label], a)
            assert compare.param_count(cfg, "core") > 0
            key, width, step = compare._widths(cfg)
            off = abs(compare.param_count(cfg, part) - exact)
            for other in (width - step, width + step):  # no neighbouring width is closer
                assert off <= abs(compare.param_count(compare._with_width(cfg, key, other), part) - exact)
        if rule == "backbone":  # FMA's own parameters come on top of the exact run's backbone
            fma = compare.run_config(rs["fma"], a)
            assert compare.param_count(fma, "backbone") == exact < compare.param_count(fma, "all")
    own = _args(tmp_path, "--scale", "smoke", "--methods", "dense,transformer_vq", "--contexts", "128",
                "--match_params", "none")
    tvq = next(r for r in compare.runs(own) if r["label"] == "transformer_vq")
    assert abs(compare.param_count(compare.run_config(tvq, own)) - exact) > 0.05 * exact


def test_results_of_another_sizing_are_refused(tmp_path):
    """A folder's results come from one sizing: a rerun with other steps is refused in one line, not mixed."""
    a = _args(tmp_path, "--methods", "dense,eva", "--contexts", "128", "--seeds", "1", "--nohybrids",
              "--report_only")
    compare.run(a)
    compare.run(a)  # the same settings: fine
    other = _args(tmp_path, "--methods", "dense,eva", "--contexts", "128", "--seeds", "1", "--nohybrids",
                  "--report_only", "--dense_steps", "999")
    with pytest.raises(ConfigError, match="other settings \\(sizes differ\\)"):
        compare.run(other)


def test_ranking_table_says_whether_the_order_settled():
    """The order of the runs by validation bits at 25/50/75/100 % of each run's budget (seed means), and whether it
    changed over the last half: a crossing at 75 % is 'still changing', a fixed order 'unchanged'."""
    def run(label, curve, steps=8):
        return {"label": label, "context": 128, "steps": steps, "curve": [[s, b] for s, b in curve]}

    a = run("a", [(2, 3.0), (4, 2.5), (6, 2.2), (8, 2.0)])
    b = run("b", [(4, 3.2), (8, 2.6), (12, 2.4), (16, 2.3)], steps=16)  # its own steps: fractions of its budget
    text = compare.ranking_table([a, b])
    assert "- 25 %: a < b" in text and "- 100 %: a < b" in text and "unchanged." in text
    late = run("b", [(2, 3.1), (4, 2.4), (6, 2.1), (8, 2.1)])  # ahead of a at 50 % and 75 %, behind at 100 %
    text = compare.ranking_table([a, late])
    assert "- 50 %: b < a" in text and "- 100 %: a < b" in text and "still changing" in text
    seeds = [run("a", [(8, 2.0)]), run("a", [(8, 3.0)]), run("b", [(8, 2.4)])]  # seed means: a 2.5 > b 2.4
    assert "- 100 %: b < a" in compare.ranking_table(seeds)


def test_pick_table_names_the_best_and_whether_its_margin_is_clear():
    def row(label, T, m, sd, n=3):
        return {"label": label, "context": T, "test_bits_per_byte": m, "test_bits_per_byte_sd": sd,
                "seeds": list(range(n))}

    rows = [row(compare.EXACT, 256, 3.0, 0.01), row(compare.WINDOW, 256, 2.62, 0.02), row("x", 256, 2.6, 0.02),
            row("y", 1024, 2.5, None, 1), row(compare.EXACT, 1024, 2.9, None, 1)]
    lines = compare.pick_table(rows).splitlines()
    r256 = next(x for x in lines if x.startswith("| 256 |"))
    assert "| x |" in r256 and f"{compare.WINDOW} +0.020 (within the spread)" in r256 and "+0.400 (clear)" in r256
    assert f"x < {compare.WINDOW} < {compare.EXACT}" in r256
    r1k = next(x for x in lines if x.startswith("| 1024 |"))
    assert "| y |" in r1k and "+0.400 (one seed)" in r1k
    tie = compare.pick_table([row(compare.EXACT, 128, 2.5, 0.01), row(compare.WINDOW, 128, 2.5, 0.01)])
    assert f"{compare.EXACT} = {compare.WINDOW}" in tie or f"{compare.WINDOW} = {compare.EXACT}" in tie


@pytest.mark.slow
def test_compare_on_a_corpus_of_files(tmp_path):
    """The same command on the user's own files (``--config.data.source=files``): the runs train and are scored on
    that corpus, and the report names the override in its command."""
    import random

    words = "def class return import self value for while if else yield lambda".split()
    r = random.Random(0)
    root = tmp_path / "corpus"
    for i in range(40):
        f = root / f"doc{i:02d}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(" ".join(r.choice(words) for _ in range(120)) + "\n")  # ~700 bytes: rows of 128 fit
    argv = ["compare", "--scale", "smoke", "--methods", "dense", "--seeds", "1", "--nohybrids", "--needle", "",
            "--out", str(tmp_path / "cmp"), "--runs", str(tmp_path / "runs"),
            "--config.data.source=files", f"--config.data.path={root}", f"--config.data.cache_dir={tmp_path / 'c'}"]
    res = compare.run(cli.parse_args(argv))
    assert not res["missing"] and [r["label"] for r in res["rows"]] == ["dense"]
    held = json.loads((tmp_path / "runs" / "dense_ctx128_seed0" / "compare_config.json").read_text())
    assert held["data"]["source"] == "files" and held["data"]["path"] == str(root)
    assert 0 < res["results"][0]["test_bits_per_byte"] < 9
    assert "--config.data.source=files" in (tmp_path / "cmp" / "compare.md").read_text()


def test_plan_writes_nothing_and_the_report_quotes_the_command_that_ran(tmp_path, capsys):
    """``--plan`` leaves the output folder as it was (a committed costs cache included); the report's command
    carries every setting that differs from its default, so rerunning it plans the same runs; the smoke scale's
    sliding window is shorter than its context; a README without the markers is refused before anything runs."""
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "costs.json").write_text('{"signature": "held", "rows": {}}')
    compare.run(_args(tmp_path, "--scale", "smoke", "--methods", "dense,swa", "--plan"))
    assert sorted(p.name for p in out.iterdir()) == ["costs.json"]
    assert json.loads((out / "costs.json").read_text())["signature"] == "held"
    argv = ["--scale", "smoke", "--methods", "dense,swa", "--seeds", "1", "--nohybrids", "--needle", "",
            "--window", "32", "--report_only"]
    a = _args(tmp_path, *argv)
    assert compare.window(_args(tmp_path, "--scale", "smoke")) < int(compare.SCALES["smoke"]["contexts"])
    cmd = compare.command(a)
    assert cmd.endswith("--methods dense,swa --seeds 1 --nohybrids --window 32 --needle ''"), cmd
    again = cli.parse_args(shlex.split(cmd)[1:])
    assert compare.runs(again) == compare.runs(a) and compare.signature(again) == compare.signature(a)
    (out / "costs.json").unlink()
    compare.run(a)
    assert cmd in (out / "compare.md").read_text()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"wrote {out / 'compare.md'}")
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ConfigError, match="no <!-- compare-pick:start -->"):
        _args(tmp_path, "--readme", str(tmp_path / "plain.md"))


def test_readme_block_rewritten_between_its_markers(tmp_path):
    """``--readme`` replaces only what lies between the compare markers; a file without them is refused."""
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\nbefore\n{compare.README_START}\nold table\n{compare.README_END}\nafter\n")
    compare.update_readme(readme, "new table\n")
    assert readme.read_text() == f"# t\nbefore\n{compare.README_START}\nnew table\n{compare.README_END}\nafter\n"
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ConfigError, match="no <!-- compare-pick:start -->"):
        compare.update_readme(tmp_path / "plain.md", "x")


def test_report_renders_the_needle_grids_and_the_main_context_evidence(tmp_path):
    """results/recall/needle/<method>/needle_grid_*.{md,png} (scripts/recall_all.sh's NEEDLE runs) and
    results/main_recipes/context/test_context_compare.{md,png} each land in BENCHMARKS with their images."""
    from longctx.bench import report

    assert not any("Needle grids" in p or "Does the context win" in p for p in report.extra_sections(tmp_path, "r"))
    (tmp_path / "recall" / "needle" / "swa").mkdir(parents=True)
    (tmp_path / "recall" / "recall.md").write_text("## Recall\n")
    (tmp_path / "recall" / "needle" / "swa" / "needle_grid_mqar_step300.md").write_text("| length | depth 1/4 |\n")
    (tmp_path / "recall" / "needle" / "swa" / "needle_grid_mqar_step300.png").write_bytes(b"png")
    ctx = tmp_path / "main_recipes" / "context"
    ctx.mkdir(parents=True)
    (tmp_path / "main_recipes" / "recipes.md").write_text("| recipe |\n")
    (ctx / "test_context_compare.md").write_text("| run | tokenizer | state |\n")
    (ctx / "test_context_compare_bpb_vs_position.png").write_bytes(b"png")
    text = "\n".join(report.extra_sections(tmp_path, "r"))
    assert text.count("### Needle grids") == 1 and "| length | depth 1/4 |" in text
    assert "](r/recall/needle/swa/needle_grid_mqar_step300.png)" in text
    assert "### Does the context win?" in text and "| run | tokenizer | state |" in text
    assert "](r/main_recipes/context/test_context_compare_bpb_vs_position.png)" in text
