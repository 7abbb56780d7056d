"""`longctx-bench` arguments: the override syntax of the other entry points, every bad input answered with one
``error:`` line and exit status 2 before anything runs, and a bench that deletes nothing it did not create."""

from __future__ import annotations

from pathlib import Path

import pytest

from longctx.bench import cli, configs, report, train_bench
from longctx.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["attention", "--lengths", "abc"], "--lengths 'abc'"),
    (["attention", "--lengths", "0"], "positive lengths"),
    (["attention", "--lengths", "1k,-4"], "positive lengths"),
    (["attention", "--methods", "nope"], "unknown method 'nope'"),
    (["attention", "--methods", "dense:nosuch"], "not a variant of dense"),
    (["attention", "--repeats", "0"], "--repeats"),
    (["attention", "--config.model.d_model=8"], "takes no --config.KEY=VALUE"),
    (["decode", "--steps", "-1"], "--steps -1"),
    (["decode", "--positions", "1k,x"], "--positions"),
    (["train", "--steps", "-1"], "--steps -1"),
    (["train", "--methods", "nope"], "unknown method"),
    (["train", "--config.model.d_model=abc"], "model.d_model='abc'"),
    (["train", "--config.model.nosuch=1"], "unknown key"),
    (["train", "--config.model.d_model"], "needs a value"),
    (["quality", "--sources", "gaussian,nope"], "--sources"),
    (["step", "--config", "no/such/config.py"], "no such config file"),
    (["step", "--batch_size", "0"], "--batch_size"),
    (["profile", "--method", "eva", "--length", "huge"], "--length 'huge'"),
    (["profile", "--method", "eva", "--length", "1k,2k"], "give one length"),
    (["profile", "--config", "no/such/config.py"], "no such config file"),
    (["profile", "--method", "nope"], "unknown method"),
    (["profile"], "give exactly one of --method"),
    (["kernels", "--lengths", "0"], "--lengths"),
    (["report", "--out", "__FILE__"], "not a folder of benchmark results"),
    (["report", "--out", "__EMPTY__"], "no benchmark JSON"),
    (["ab", "nowhere_a", "nowhere_b", "--method", "eva"], "not a source tree"),
    (["attention", "--nosuchflag"], "unrecognized arguments"),
    (["attention", "--method", "dense"], "did you mean --methods?"),  # absl takes no abbreviations
    (["attention", "--dtype", "int8"], "--dtype=int8"),
    (["attention", "--repeats", "x"], "--repeats=x"),
    (["attention", "stray"], "unrecognized arguments: stray"),
    (["ab", "nowhere_a", "--method", "eva"], "required: tree_b"),
    (["dropin", "--method", "eva"], "required: --workdir"),
    (["speed"], "invalid choice: 'speed'"),
])
def test_bad_inputs_give_one_error_line_and_exit_2(tmp_path, capsys, argv, message):
    f = tmp_path / "a_file"
    f.write_text("x")
    (tmp_path / "empty").mkdir()
    argv = [{"__FILE__": str(f), "__EMPTY__": str(tmp_path / "empty")}.get(a, a) for a in argv]
    if argv[0] != "report":
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_parse_args_checks_without_running(tmp_path):
    args = cli.parse_args(["step", "--config", "configs/default.py", "--config.model.d_model=128",
                           "--config.train.seq_len", "64", "--lengths", "1k", "--out", str(tmp_path / "o")])
    assert args.overrides == ["model.d_model=128", "train.seq_len=64"] and args.command == "step"
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError):
        cli.parse_args(["train", "--config.model.d_model=abc"])
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["attention", "--nosuch"])
    assert e.value.code == 2


def test_flag_spellings():
    """absl's spellings (``--name value``, ``--name=value``, ``--noname``; one spelling per flag: the old
    ``--no_NAME`` of a boolean that defaults to true is refused), a repeatable flag, positional arguments between
    the flags."""
    a = cli.parse_args(["attention", "--lengths", "1k,4k", "--noisolate", "--noprogress", "--no_backward",
                        "--group", "eva,dense", "--group=dense,dense", "--causal"])
    assert (a.lengths, a.isolate, a.progress, a.no_backward, a.causal) == ("1k,4k", False, False, True, True)
    assert a.group == ["eva,dense", "dense,dense"] and a.command == "attention" and a.overrides == []
    b = cli.parse_args(["attention", "--noisolate", "--noprogress", "--lengths=2k"])
    assert (b.isolate, b.progress, b.no_backward, b.lengths, b.group) == (False, False, False, "2k", [])
    with pytest.raises(SystemExit):
        cli.parse_args(["attention", "--no_isolate"])
    c = cli.parse_args(["compare", "--plan", "--nohybrids", "--seeds", "1"])
    assert c.plan is True and c.hybrids is False and c.seeds == 1 and c.out == "results/compare"
    d = cli.parse_args(["ab", str(REPO), "--method", "eva", str(REPO / "."), "--config.model.attention.eva.chunk_size=8"])
    assert (d.tree_a, d.tree_b, d.method) == (str(REPO), str(REPO / "."), "eva")
    assert d.overrides == ["model.attention.eva.chunk_size=8"]
    assert not hasattr(cli.parse_args(["report", "--out", str(REPO / "results")]), "progress")
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["attention", "--lengths"])
    assert e.value.code == 2


def test_help_lists_commands_and_flags(capsys):
    for argv in (["--help"], ["attention", "--help"], ["ab", "-h"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in ("attention", "decode", "compare", "report"))
    assert "usage: longctx-bench attention [flags]" in out and "--[no]isolate" in out and "--lengths:" in out
    assert "usage: longctx-bench ab TREE_A TREE_B [flags]" in out and "--config.KEY=VALUE" in out


def test_sub_command_help_imports_no_orbax():
    """``longctx-bench SUB --help`` starts without the checkpoint library (the ``# deferred:`` imports)."""
    import subprocess
    import sys

    code = ("import sys\nfrom longctx.bench import cli\ntry:\n    cli.main(['compare', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'orbax'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout[-2000:]


def test_set_is_no_flag():
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["train", "--set", "model.d_model=64"])
    assert e.value.code == 2


def test_configs_resolve_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert configs.find_config("configs/default.py") == REPO / "configs" / "default.py"
    cfg, src = configs.method_config("eva")
    assert cfg.model.attention.name == "eva" and src.startswith("configs/")
    (tmp_path / "mine.py").write_text("from longctx.config import base_config\n\n"
                                      "def get_config(arg=None):\n    c = base_config()\n"
                                      "    c.model.d_model = 96 if arg == 'small' else 128\n    return c\n")
    assert configs.load_config_file("mine.py").model.d_model == 128
    assert configs.load_config_file("mine.py:small").model.d_model == 96
    assert cli.parse_args(["step", "--config", "mine.py"]).out == "bench_out"  # relative to the cwd


def test_train_never_deletes_a_folder_it_did_not_create(tmp_path, capsys):
    runs = tmp_path / "runs"
    mine = runs / "dense"
    mine.mkdir(parents=True)
    (mine / "precious.txt").write_text("a user's run")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--methods", "dense", "--runs", str(runs), "--out", str(tmp_path / "o"), "--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "was not created by longctx-bench train" in err and "nothing was deleted" in err
    assert (mine / "precious.txt").read_text() == "a user's run"
    (mine / train_bench.MARKER).write_text("")  # a folder the bench made: it may be replaced
    cli.parse_args(["train", "--methods", "dense", "--runs", str(runs)])


def test_report_from_results_keeps_the_reading(tmp_path):
    """The committed results/ renders; the summary comes first; the hand-written part survives."""
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("# Benchmarks\n\n## How to read this\n\nHand-written.\n\n## Old generated section\n\nx\n")
    text = report.build(REPO / "results", target, REPO / "scripts" / "bench_all.sh")
    assert text.index("## Summary: causal attention at 32k") < text.index("## How to read this\n\nHand-written.")
    assert "## Old generated section" not in text and "torch_sdpa" in text
    for folder in ("attention_8k_32k", "peer_eva", "peer_tvq", "recall", "kernels_gpu", "compare", "compare_total"):
        assert f"`{folder}/" in text, folder
    import re

    assert not re.search(r"(?i)(session|issue) [0-9]+", text)


def test_precision_section_sets_bf16_beside_fp32(tmp_path):
    """results/precision/<dtype>/train.json -> one row per method, the relative difference, and a flag past 2 %."""
    import json

    rows = {"float32": {"dense": 2.50, "eva": 2.40}, "bfloat16": {"dense": 2.49, "eva": 2.50}}
    for dt, vals in rows.items():
        (tmp_path / "precision" / dt).mkdir(parents=True)
        (tmp_path / "precision" / dt / "train.json").write_text(json.dumps({
            "header": {"args": {"steps": 300, "eval_tokens": 32768, "overrides": [f"model.dtype={dt}"]}},
            "rows": [{"method": m, "config_file": f"configs/builtin/{m}.py", "params": 10, "steps": 300,
                      "valid_bits_per_byte": v, "tokens_per_s": 1000.0} for m, v in vals.items()]}))
    text = "\n".join(report.precision_section(tmp_path))
    assert "| dense | `configs/builtin/dense.py` | 10 | 300 | 2.5000 | 2.4900 | -0.40% | yes |" in text
    assert "| eva | `configs/builtin/eva.py` | 10 | 300 | 2.4000 | 2.5000 | +4.17% | **no** |" in text
    assert "--config.model.dtype=bfloat16" in text and "Largest difference: 4.17%" in text
    assert "trained again at other seeds" not in text
    for dt, v in (("float32", 2.40), ("bfloat16", 2.424)):  # eva at seed 1: +1.00 %
        (tmp_path / "precision" / "seed1" / dt).mkdir(parents=True)
        (tmp_path / "precision" / "seed1" / dt / "train.json").write_text(json.dumps({
            "rows": [{"method": "eva", "valid_bits_per_byte": v}]}))
    text = "\n".join(report.precision_section(tmp_path))
    assert "| eva | 0 | 2.4000 | 2.5000 | +4.17% |" in text and "| eva | 1 | 2.4000 | 2.4240 | +1.00% |" in text
    assert "| eva | mean of 2 | fp32 alone spans 2.4000-2.4000 (0.00%) | | **+2.58%** |" in text and "| dense | 1 |" not in text
    assert report.precision_section(tmp_path / "nothing") == []


def test_step_draws_tokens_from_the_configs_own_vocabulary():
    from longctx import config_files
    from longctx.bench import step_bench

    words = config_files.load("configs/wikitext103/eva_16l.py")  # data.tokenizer='words', model.vocab_size 0
    with pytest.raises(ConfigError, match=r"'words' learns its vocabulary .*: give --vocab_size \(e.g. 267735"):
        step_bench.vocab_size(words, None)
    assert step_bench.vocab_size(words, 1000) == 1000
    assert step_bench.vocab_size(config_files.load("configs/wikitext103/eva_16l.py:node8"), None) == 267_735
    assert step_bench.vocab_size(config_files.load("configs/enwik8/fma.py"), None) == 256  # bytes
    spm = config_files.load("configs/pg19/dense.py")  # sentencepiece: data.options.vocab_size pieces, 0: 32,000
    assert step_bench.vocab_size(spm, None) == 32_000
    with spm.unlocked():
        spm.data.options.vocab_size = 0
    assert step_bench.vocab_size(spm, None) == 32_000


def test_step_resolves_the_readme_configs_bpe_vocabulary_without_the_flag():
    """README's `longctx-bench step --config=configs/main.py --lengths=1k,4k`: a BPE tokenizer has exactly
    data.options.vocab_size ids (4,096 in configs/main.py), as `longctx-train --dry_run` plans it."""
    from types import SimpleNamespace

    from longctx.bench import configs, step_bench

    main = configs.load_config_file("configs/main.py")
    assert main.data.tokenizer == "bpe" and main.model.vocab_size == 0
    args = SimpleNamespace(batch_size=1, window=0, vocab_size=None)
    for T in (1024, 4096):
        assert step_bench.length_config(main, T, args).model.vocab_size == main.data.options.vocab_size == 4096
    assert step_bench.length_config(main, 1024, SimpleNamespace(batch_size=1, window=0, vocab_size=300)
                                    ).model.vocab_size == 300
    with main.unlocked():
        main.data.options.vocab_size = 0  # the tokenizer's default
    assert step_bench.vocab_size(main, None) == 4096


def test_gpu_check_section_shows_each_accelerator_report(tmp_path):
    import json

    (tmp_path / "gpu").mkdir()
    rep = {"env": {"device": "NVIDIA H200", "jax": "0.11.2", "commit": "abc", "smoke": False},
           "steps": {"env": {"status": "ok", "wall_s": 2}, "memplan": {"status": "not run"}},
           "tests": {"tests": 146, "failures": 0, "skipped": 20, "counted_from_log": True},
           "steps_model": {"step_tvq": {"config": "configs/enwik8/transformer_vq.py", "sets": ["model.num_layers=2"],
                                        "rows": [{"T": 8192, "window": 2048, "batch_size": 8, "tokens_per_s": 8e5,
                                                  "model_flops_per_token": 6.7e7, "mfu": 0.054, "compile_s": 14.4,
                                                  "device_peak_bytes": 2**30, "forward_flops_opaque": ["pallas_call"]}]}},
           "kernels": [{"method": "eva", "kernel": "k", "length": 8192, "xla_fwd_s": 3.6e-3, "pallas_fwd_s": 1.7e-3}]}
    (tmp_path / "gpu" / "2026-01-01-H200.json").write_text(json.dumps(rep))
    (tmp_path / "gpu" / "2026-01-01-cpu-smoke.json").write_text(json.dumps({"env": {"smoke": True}}))
    text = "\n".join(report.gpu_check_section(tmp_path))
    assert "2026-01-01-H200: NVIDIA H200, jax 0.11.2" in text and "smoke" not in text
    assert "146 run, 0 failed" in text and "memplan" not in text and "env ok (2 s)" in text
    assert "| 8192 in windows of 2048 | 8 | 800,000 | ≥67 | ≥5.4 | 14.4 | 1,024 |" in text
    assert "| eva: k | 8192 | 3.6 | 1.7 | – | – | – |" in text
    assert report.gpu_check_section(tmp_path / "nothing") == []


def test_kernel_bench_runs_the_kernels_in_the_order_asked():
    from longctx.bench.kernel_bench import kernel_cells

    assert [m for m, _, _ in kernel_cells(["transformer_vq", "fma", "eva"])] == ["transformer_vq", "fma", "eva"]
    assert [m for m, _, _ in kernel_cells(["fma", "eva"])] == ["fma", "eva"]
