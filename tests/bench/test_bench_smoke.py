"""Smoke test of every `longctx-bench` sub-command on tiny sizes: the JSON, markdown and PNG
files are written and well-formed. No timing assertions."""

from __future__ import annotations

import json

import pytest
from conftest import write_corpus

from longctx.bench import cli, report, train_bench

pytestmark = pytest.mark.xdist_group("bench_smoke")  # one shared fixture: keep its tests on one worker

TINY_MODEL = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.head_dim=16", "model.d_ff=64",
              "train.seq_len=32", "train.batch_size=2", "eval.max_bytes=256"]


def _sets(corpus, cache):
    return [f"--config.{s}" for s in [f"data.path={corpus}", f"data.cache_dir={cache}"] + TINY_MODEL]


@pytest.fixture(scope="session")  # session: xdist may interleave other modules between these tests
def bench_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    corpus = write_corpus(root / "corpus")
    out = root / "out"
    sets = _sets(corpus, root / "cache")
    common = ["--out", str(out), "--noprogress"]
    # --noisolate: both variants in this process (a child process per variant costs an interpreter and jax's import
    # each); the real child path is test_attention_times_a_variant_in_a_child_process's
    assert cli.main(["attention", *common, "--methods", "dense", "--lengths", "64,128", "--repeats", "1",
                     "--causal", "--matmul_n", "128", "--no_torch", "--noisolate"]) == 0
    assert cli.main(["decode", *common, "--methods", "dense", "--positions", "64,128", "--steps", "2",
                     "--warmup", "1", "--prefill_chunk", "64"]) == 0
    assert cli.main(["quality", *common, "--methods", "dense,eva", "--lengths", "64", "--seeds", "2", "--causal",
                     "--workdir", str(root / "qrun"), "--train_steps", "2", *sets]) == 0
    assert cli.main(["train", *common, "--methods", "dense", "--steps", "2", "--eval_tokens", "128",
                     "--runs", str(root / "runs"), "--noxla_mem", *sets]) == 0
    # --matmul_n 128: MFU's CPU peak from a small matmul (the default 4096 x 4096 one costs more than the steps)
    assert cli.main(["step", *common, "--lengths", "32,64", "--batch_size", "2", "--repeats", "2", "--warmup", "0",
                     "--matmul_n", "128",
                     *[f"--config.{s}" for s in TINY_MODEL[:5]]]) == 0
    assert cli.main(["kernels", *common, "--methods", "eva", "--lengths", "48", "--causal", "--heads", "2",
                     "--head_dim", "16", "--repeats", "1", "--warmup", "0"]) == 0
    assert cli.main(["report", "--out", str(out), "--output", str(root / "BENCHMARKS.md")]) == 0
    return out, root


def _png_ok(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.parametrize("name,pngs", [
    ("attention", ["attention_time_causal.png", "attention_memory_causal.png"]),
    ("decode", ["decode.png"]),
    ("quality", ["quality_causal.png"]),
    ("train", ["train.png"]),
    ("step", ["step_tokens_per_s.png"]),
    ("kernels", ["kernels.png"]),
])
def test_outputs(bench_out, name, pngs):
    out, _ = bench_out
    res = json.loads((out / f"{name}.json").read_text())
    assert res["header"]["command"] == name and res["rows"]
    assert all(r.get("status", r.get("fwd_status")) for r in res["rows"])
    md = (out / f"{name}.md").read_text()
    assert md.count("|") > 10 and "---" in md
    for p in pngs:
        assert _png_ok(out / p), p


def test_contents(bench_out):
    out, _ = bench_out
    ker = json.loads((out / "kernels.json").read_text())
    assert [(r["method"], r["kernel"], r["direction"], r["mode"]) for r in ker["rows"]] == [
        ("eva", "eva_chunk_stats+eva_attend", "causal", "interpret")]
    (kr,) = ker["rows"]
    assert all(kr[f"{i}_{k}_status"] == "ok" and kr[f"{i}_{k}_s"] > 0 for i in ("xla", "pallas") for k in ("fwd", "fwdbwd"))
    assert 0 < kr["max_abs_diff_out"] < 1e-4 and 0 < kr["max_rel_diff_grad"] < 1e-4  # two paths, one function
    att = json.loads((out / "attention.json").read_text())
    assert {r["variant"] for r in att["rows"]} == {"dense:naive", "dense:blockwise"}
    assert all(r["fwd_status"] == "ok" and r["fwd_s"] > 0 and r["fwdbwd_s"] > 0 for r in att["rows"])
    assert all(r["fwd_xla_mem"]["total"] > 0 for r in att["rows"]) and att["matmul"]["jax_gflops"] > 0
    dec = json.loads((out / "decode.json").read_text())
    assert all(r["status"] == "ok" and r["state_bytes"] > 0 for r in dec["rows"])
    q = json.loads((out / "quality.json").read_text())
    by = {(r["variant"], r["source"]): r for r in q["rows"]}
    assert by[("dense:naive", "gaussian")]["rel_err"] == 0.0
    assert by[("dense:blockwise", "captured")]["rel_err"] < 1e-4
    assert by[("eva", "gaussian")]["status"] == "ok" and by[("eva", "gaussian")]["randomized"]
    assert len(by[("eva", "gaussian")]["rel_err_seeds"]) == 2
    tr = json.loads((out / "train.json").read_text())
    assert tr["rows"][0]["status"] == "ok" and tr["rows"][0]["valid_bits_per_byte"] > 0
    st = json.loads((out / "step.json").read_text())
    assert [r["T"] for r in st["rows"]] == [32, 64] and all(len(r["step_s_all"]) == 2 for r in st["rows"])
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["params"] > 0 for r in st["rows"])


def test_report(bench_out):
    _, root = bench_out
    text = (root / "BENCHMARKS.md").read_text()
    assert report.READING_MARKER in text
    for s in ("## Summary: causal attention at 128", "## Machine and provenance", "## Attention", "## Decoding",
              "## Quality", "## Training", "## Pallas kernels", ".png)"):
        assert s in text
    assert text.index("## Summary") < text.index("## How to read this") < text.index("## Machine")


def test_train_records_its_run_folders(bench_out):
    _, root = bench_out
    assert (root / "runs" / "dense" / train_bench.MARKER).is_file()


def test_report_keeps_what_a_human_wrote(bench_out, tmp_path):
    out, root = bench_out
    first = (root / "BENCHMARKS.md").read_text()
    reading = "## How to read this\n\nThe figures say X.\n\n- and Y."
    edited = first.replace(f"## How to read this\n\n{report.READING_MARKER}", reading, 1)
    assert edited != first
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(edited)
    assert cli.main(["report", "--out", str(out), "--output", str(target)]) == 0
    text = target.read_text()
    assert reading + "\n\n## Machine" in text and report.READING_MARKER not in text
    # a second regeneration changes nothing
    assert cli.main(["report", "--out", str(out), "--output", str(target)]) == 0
    assert target.read_text() == text


def test_kernels_rejects_a_method_without_a_kernel(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["kernels", "--out", str(tmp_path), "--methods", "dense", "--noprogress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "dense declare(s) no Pallas kernel" in err and "transformer_vq" in err


def test_kernels_keeps_the_rows_of_a_stopped_run(tmp_path, monkeypatch):
    """A run stopped during its second length (here: an interrupt from the timer) leaves the first length's row in
    kernels.partial.json; a completed run removes that file (see bench_out: kernels.json and no partial)."""
    from longctx.bench import kernel_bench as kb

    calls = []
    real = kb.C.time_calls

    def stop_on_second_length(fn, *a, **k):
        calls.append(1)
        if len(calls) > 4:  # xla/pallas x fwd/fwd+bwd of the first length ran
            raise KeyboardInterrupt
        return real(fn, *a, **k)

    monkeypatch.setattr(kb.C, "time_calls", stop_on_second_length)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["kernels", "--out", str(tmp_path), "--noprogress", "--methods", "eva", "--lengths", "32,48",
                  "--causal", "--heads", "2", "--head_dim", "16", "--repeats", "1", "--warmup", "0"])
    part = json.loads((tmp_path / kb.PARTIAL).read_text())
    assert [r["length"] for r in part["rows"]] == [32] and part["rows"][0]["status"] == "ok"
    assert part["header"]["command"] == "kernels" and not (tmp_path / "kernels.json").exists()


def test_completed_kernels_run_leaves_no_partial(bench_out):
    out, _ = bench_out
    assert (out / "kernels.json").exists() and not (out / "kernels.partial.json").exists()


def test_attention_isolates_each_variant_and_reports_a_failed_child(monkeypatch):
    import sys
    from types import SimpleNamespace

    from longctx.bench import attention_bench as ab

    args = SimpleNamespace(lengths="64,128", batch=1, heads=2, head_dim=16, dtype="float32", repeats=1, warmup=0,
                           mem_budget_gb=1.0, max_cell_s=5.0, seed=0, causal=True, bidirectional=False,
                           no_backward=False)
    argv = ab.child_argv(args, "dense:blockwise", "/tmp/x")
    assert argv[argv.index("--methods") + 1] == "dense:blockwise" and "--noisolate" in argv
    assert "--no_torch" in argv and "--causal" in argv and "--bidirectional" not in argv
    assert argv[argv.index("--lengths") + 1] == "64,128" and argv[argv.index("--warmup") + 1] == "0"
    assert "--no_torch" not in ab.child_argv(args, ab.TORCH, "/tmp/x")
    one = ab.child_argv(args, "eva", "/tmp/x", causal=False)
    assert "--bidirectional" in one and "--causal" not in one
    monkeypatch.setattr(ab, "child_argv", lambda *a: [sys.executable, "-c", "import sys; sys.exit('boom: no memory')"])
    res = ab._run_child(args, "eva", True)
    assert res["rows"] == [] and res["skipped_variants"][0]["variant"] == "eva"
    assert "status 1" in res["skipped_variants"][0]["reason"] and "boom: no memory" in res["skipped_variants"][0]["reason"]


def test_attention_times_a_variant_in_a_child_process():
    """The isolated run's real path: child_argv's command line runs in a child process, which writes its rows, and
    the parent reads them back (one variant, one length, forward only: the child's cost is its start-up)."""
    from types import SimpleNamespace

    from longctx.bench import attention_bench as ab

    args = SimpleNamespace(lengths="64", batch=1, heads=2, head_dim=16, dtype="float32", repeats=1, warmup=0,
                           mem_budget_gb=1.0, max_cell_s=5.0, seed=0, causal=True, bidirectional=False,
                           no_backward=True)
    res = ab._run_child(args, "dense:naive", True)
    assert res["skipped_variants"] == []
    assert [(r["variant"], r["direction"], r["length"], r["fwd_status"]) for r in res["rows"]] == [
        ("dense:naive", "causal", 64, "ok")]
    assert res["rows"][0]["fwd_s"] > 0


def test_a_killed_child_keeps_its_finished_rows_and_update_merges(monkeypatch, tmp_path):
    """A child killed mid-run (here SIGKILL after writing its progress file, as the out-of-memory killer would)
    keeps the rows it finished and names the cell it died in; --update replaces only the rows it reran."""
    import json
    import os
    import signal
    import sys
    from types import SimpleNamespace

    from longctx.bench import attention_bench as ab

    done = {"variant": "eva", "direction": "causal", "length": 64, "fwd_s": 0.5}
    script = (f"import json, os, signal, sys; out = sys.argv[sys.argv.index('--out') + 1]; "
              f"json.dump({{'rows': [{done!r}], 'skipped_variants': [], 'current': {{'variant': 'eva', "
              f"'direction': 'causal', 'length': 2048, 'kind': 'fwdbwd'}}}}, "
              f"open(os.path.join(out, {ab.PARTIAL!r}), 'w')); os.kill(os.getpid(), {int(signal.SIGKILL)})")
    monkeypatch.setattr(ab, "child_argv", lambda args, label, out, causal=None: [sys.executable, "-c", script,
                                                                                  "--out", out])
    res = ab._run_child(SimpleNamespace(), "eva", True)
    assert res["rows"] == [done]
    (skip,) = res["skipped_variants"]
    assert skip["direction"] == "causal" and "status -9 during fwdbwd at T=2k" in skip["reason"]
    assert "1 rows before it are kept" in skip["reason"]

    old = {"header": {"time": "t0", "git_sha": "a"}, "skipped_variants": [{"variant": "eva", "direction": "all",
                                                                          "reason": "killed"},
                                                                         {"variant": "fma", "direction": "all",
                                                                          "reason": "killed"}],
           "rows": [{"variant": "eva", "direction": "causal", "length": 64, "fwd_s": 9.0},
                    {"variant": "eva", "direction": "bidirectional", "length": 64, "fwd_s": 8.0},
                    {"variant": "dense", "direction": "causal", "length": 64, "fwd_s": 7.0}]}
    (tmp_path / "attention.json").write_text(json.dumps(old))
    new = {"header": {"time": "t1", "git_sha": "b"}, "rows": res["rows"], "skipped_variants": []}
    merged = ab.merge_into_previous(tmp_path / "attention.json", new, {("eva", "causal")})
    assert sorted((r["variant"], r["direction"], r["fwd_s"]) for r in merged["rows"]) == [
        ("dense", "causal", 7.0), ("eva", "bidirectional", 8.0), ("eva", "causal", 0.5)]
    assert [s["variant"] for s in merged["skipped_variants"]] == ["fma"]  # eva's old skip went with its rerun
    assert merged["merged_into"]["git_sha"] == "a"
    assert os.path.exists(tmp_path / "attention.json")


def test_decode_skips_a_core_whose_state_lives_in_its_stack_wrapper(tmp_path):
    """vcc's decoding state is its stack wrapper's: the core-level decode benchmark reports a skip with the
    reason, never an error row."""
    assert cli.main(["decode", "--out", str(tmp_path), "--noprogress", "--methods", "vcc", "--positions", "64",
                     "--steps", "1", "--warmup", "0"]) == 0
    dec = json.loads((tmp_path / "decode.json").read_text())
    assert dec["rows"] == []
    (skip,) = dec["skipped_methods"]
    assert skip["method"] == "vcc" and "stack wrapper" in skip["reason"]
    assert "vcc" in (tmp_path / "decode.md").read_text()


def test_quality_says_it_trains_before_it_does_and_prints_its_table(bench_out, tmp_path, monkeypatch, capsys):
    """`longctx-bench quality` with the captured source says up front whether it trains the capture model (minutes)
    or reuses --workdir's; like `attention` it ends with its table and a `wrote` line."""
    from longctx.bench import capture

    _, root = bench_out
    out = tmp_path / "q"
    assert cli.main(["quality", "--out", str(out), "--noprogress", "--methods", "eva", "--lengths", "64", "--seeds",
                     "1", "--causal", "--sources", "captured", "--workdir", str(root / "qrun"), "--baselines="]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"quality: capturing q/k/v from the model already trained in {root / 'qrun'} (reused)"
    assert lines[1].startswith("| variant | direction | source | T |") and lines[3].startswith("| eva | causal | "
                                                                                                 "captured | 64 |")
    assert lines[-1] == f"wrote {out / 'quality.json'}, {out / 'quality.md'}, {out / 'quality_causal.png'}"

    def stop(*a, **k):
        raise RuntimeError("training would start here")

    monkeypatch.setattr(capture, "ensure_checkpoint", stop)
    with pytest.raises(RuntimeError, match="training would start here"):
        cli.main(["quality", "--out", str(out), "--noprogress", "--methods", "eva", "--lengths", "64", "--causal",
                  "--workdir", str(tmp_path / "fresh"), "--train_steps", "7"])
    assert capsys.readouterr().out.splitlines() == [
        f"quality: training the capture model first: 7 steps of a tiny dense model into {tmp_path / 'fresh'} "
        "(reused by later runs; --sources gaussian skips it)"]


def test_decode_says_what_it_times_and_prints_its_table(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["decode", "--out", str(out), "--noprogress", "--methods", "eva,vcc", "--positions", "64",
                     "--steps", "2", "--warmup", "1", "--prefill_chunk", "32", "--heads", "2", "--head_dim", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("decode: 2 method(s) at positions 64: each prefilled to the position in chunks of 32 tokens, "
                        "then 2 single-token calls timed after 1 warm-up")
    assert lines[1].startswith("skip vcc: its decoding state lives")  # said when it happens, and again at the end
    assert lines[2].startswith("| method | position | ms / token |") and lines[4].startswith("| eva | 64 | ")
    assert lines[4].endswith("| ok |") and lines[-2].startswith("not run: vcc: its decoding state lives")
    assert lines[-1] == f"wrote {out / 'decode.json'}, {out / 'decode.md'}, {out / 'decode.png'}"


def test_train_update_replaces_only_the_methods_rerun(tmp_path):
    """`longctx-bench train --update`: the rerun methods' rows replace theirs in place, new ones go last, the
    others stay, and the earlier header is kept under merged_into."""
    from longctx.bench.train_bench import merge_rows

    path = tmp_path / "train.json"
    path.write_text(json.dumps({"header": {"run": 1}, "rows": [{"method": "a", "x": 1}, {"method": "b", "x": 1}]}))
    res = merge_rows(path, {"header": {"run": 2}, "rows": [{"method": "b", "x": 2}, {"method": "c", "x": 2}]})
    assert res["rows"] == [{"method": "a", "x": 1}, {"method": "b", "x": 2}, {"method": "c", "x": 2}]
    assert res["header"] == {"run": 2} and res["merged_into"] == {"run": 1, "merged_into": None}
    assert merge_rows(tmp_path / "none.json", res) is res


def test_attention_times_variants_in_the_order_asked_and_keeps_finished_ones(tmp_path, monkeypatch):
    """`--methods` order is the timing order (an exact baseline named first is timed first), and in the isolated
    mode the parent writes the rows of every finished variant before the next starts (a run stopped by a time limit
    keeps them)."""
    from longctx.bench import attention_bench as ab

    out = tmp_path / "o"
    assert cli.main(["attention", "--out", str(out), "--noprogress", "--noisolate", "--methods",
                     "transformer_vq,dense:naive", "--lengths", "32", "--repeats", "1", "--warmup", "0", "--causal",
                     "--matmul_n", "0", "--no_torch", "--no_backward", "--batch", "1", "--heads", "2",
                     "--head_dim", "8"]) == 0
    res = json.loads((out / "attention.json").read_text())
    assert [r["variant"] for r in res["rows"]] == ["transformer_vq", "dense:naive"]

    seen = []  # what the partial file held when each child started

    def child(args, label, causal):
        part = out2 / ab.PARTIAL
        seen.append([r["variant"] for r in json.loads(part.read_text())["rows"]] if part.exists() else None)
        return {"rows": [{"variant": label, "direction": "causal", "length": 32}], "skipped_variants": []}

    out2 = tmp_path / "p"
    monkeypatch.setattr(ab, "_run_child", child)
    monkeypatch.setattr(ab, "plots", lambda *a, **k: None)
    assert cli.main(["attention", "--out", str(out2), "--noprogress", "--methods", "eva,dense:naive", "--lengths",
                     "32", "--causal", "--matmul_n", "0", "--no_torch"]) == 0
    assert seen == [None, ["eva"]]


def test_attention_says_a_requested_torch_baseline_cannot_run(tmp_path, monkeypatch, capsys):
    """`--methods ...,torch_sdpa` where torch cannot be imported: one skip line per direction, the same reason in the
    JSON's skipped variants and in the markdown, the other methods timed; the implicit reference that an exact
    method brings along is dropped without a skip."""
    import sys

    from longctx.bench import attention_bench as ab

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises, as where it is not installed
    assert ab._torch()[0] is None and "torch is not importable (ModuleNotFoundError" in ab._torch()[2]
    small = ["--lengths", "32", "--repeats", "1", "--warmup", "0", "--matmul_n", "0", "--no_backward", "--batch", "1",
             "--heads", "2", "--head_dim", "8", "--noisolate"]
    out = tmp_path / "o"
    assert cli.main(["attention", "--out", str(out), "--noprogress", "--methods", "dense:naive,torch_sdpa", "--causal",
                     *small]) == 0
    said = capsys.readouterr().out
    assert said.count("skip torch_sdpa (causal): torch is not importable (ModuleNotFoundError") == 1
    assert "not run: torch_sdpa causal: torch is not importable" in said and f"wrote {out / 'attention.json'}" in said
    res = json.loads((out / "attention.json").read_text())
    assert [r["variant"] for r in res["rows"]] == ["dense:naive"]
    assert [(s["variant"], s["direction"]) for s in res["skipped_variants"]] == [("torch_sdpa", "causal")]
    assert "torch is not importable" in res["skipped_variants"][0]["reason"]
    assert "`torch_sdpa` causal: not run — torch is not importable" in (out / "attention.md").read_text()

    assert cli.main(["attention", "--out", str(out), "--noprogress", "--methods", "torch_sdpa", "--no_torch",
                     "--bidirectional", *small]) == 0
    res = json.loads((out / "attention.json").read_text())
    assert res["rows"] == [] and res["skipped_variants"] == [{"variant": "torch_sdpa", "direction": "bidirectional",
                                                              "reason": "--no_torch"}]
    assert "skip torch_sdpa (bidirectional): --no_torch" in capsys.readouterr().out
    assert cli.main(["attention", "--out", str(out), "--noprogress", "--methods", "dense:naive", "--causal", *small]) == 0
    assert json.loads((out / "attention.json").read_text())["skipped_variants"] == []
    assert "skip torch_sdpa" not in capsys.readouterr().out


def test_kernel_cells_time_a_gpu_only_kernel_on_its_gpu_only():
    """A kernel declared for the GPU alone (FMA's, KDEformer's Mosaic GPU kernels) is no cell on a CPU, one on cuda;
    a run without a platform asks its device's kernel platform (``dispatch.current_platform``: 'cuda' on an NVIDIA
    GPU, where JAX's backend name is 'gpu')."""
    from longctx.bench import kernel_bench

    names = lambda plat, m="fma": [k for _, k, _ in kernel_bench.kernel_cells([m], plat)]  # noqa: E731
    assert names("cpu") == ["fma_blocks"]
    assert names("cuda") == ["fma_blocks", "fma_blocks_mgpu"]
    assert names("cuda", "kdeformer") == ["kde_band", "kde_band_mgpu"]
    assert names(None) == names(kernel_bench.dispatch.current_platform())


def test_decode_times_a_whole_model_with_each_method(tmp_path):
    """``--model``: the config's model with each method as its attention (its own position encoding where the
    config's is not one it takes, a length-sized setting at the longest position), its layers scanned when asked;
    VCC, whose blocks run inside its stack wrapper, cannot be scanned: a skip with the reason."""
    out = tmp_path / "m"
    assert cli.main(["decode", "--out", str(out), "--noprogress", "--model", "configs/main.py", "--methods",
                     "dense,transformer_vq,vcc", "--positions", "96", "--steps", "1", "--warmup", "0",
                     "--prefill_chunk", "64", "--scan_layers", "on"]) == 0
    dec = json.loads((out / "decode.json").read_text())
    (skip,) = dec["skipped_methods"]
    assert skip["method"] == "vcc" and "stack wrapper" in skip["reason"]
    rows = {r["method"]: r for r in dec["rows"]}
    assert set(rows) == {"dense", "transformer_vq"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["dense"]["scan_layers"] == "on" and rows["dense"]["layers"] == 4
    assert rows["transformer_vq"]["positions"] != "rotary"
    assert "The whole model of `configs/main.py` (4 layers, scan_layers on" in (out / "decode.md").read_text()
