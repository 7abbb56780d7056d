"""`longctx-bench profile`: the trace is joined to the compiled module (op, kind, source line). No timing assertions."""

from __future__ import annotations

import collections
import glob
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from longctx.attention.dense import naive_attention
from longctx.bench import cli, profile_bench
from longctx.bench.profile_bench import NO_SOURCE, SOURCE_ROOT, hlo_index, instruction_of, op_kind, summarize

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]  # the checkout (configs/)


def _attention_here(x):  # this file's frame, the caller of an op made in longctx/attention/dense/reference.py
    pos = jnp.arange(x.shape[2])
    return naive_attention(x, x, x, pos, pos, pos >= 0, causal=True)


def test_sources_walk_the_stack_to_the_frame_under_root():
    """Ops made in longctx/attention/dense/reference.py, called from this file: with root = this file's folder the walk
    follows the parent links up to this file's frame (a wrong parent offset stops at the innermost frame);
    with root = longctx/ the innermost frame itself is the answer."""
    text = jax.jit(_attention_here).lower(jnp.ones((1, 2, 16, 8))).compile().as_text()
    here = {rec["source"] for rec in hlo_index(text, root=HERE.parent).values()}
    assert any(s.startswith("test_profile.py:") and "_attention_here" in s for s in here), here
    assert not any("reference.py" in s for s in here), here
    inner = {rec["source"] for rec in hlo_index(text, root=SOURCE_ROOT / "longctx").values()}
    assert any(s.startswith("attention/dense/reference.py:") and "naive_attention" in s for s in inner), inner


def test_summarize_matches_events_to_instructions_only():
    index = {"dot.3": {"shape": "f32[2,2]", "opcode": "dot", "root": None, "op_name": "", "source": "a.py:1 (f)"},
             "ynn_fusion.1": {"shape": "f32[2]", "opcode": "fusion", "root": "reduce", "op_name": "",
                              "source": NO_SOURCE}}
    events = {"duration_ns": {"dot.3": 4_000_000, "ynn_fusion.1": 2_000_000, "ThunkExecutor::Execute": 9_000_000},
              "count": {"dot.3": 2, "ynn_fusion.1": 2, "ThunkExecutor::Execute": 2}, "device": False}
    s = summarize(events, index, n=2)
    assert s["total_ms"] == pytest.approx(3.0) and s["unmatched"] == []  # a CPU's other events are not ops
    assert [(r["kind"], r["ms"]) for r in s["kinds"]] == [("dot", 2.0), ("ynn_fusion [reduce]", 1.0)]
    assert op_kind("copy_bitcast_fusion.12", "copy") == "copy_bitcast_fusion [copy]"


def test_gpu_kernels_are_matched_by_name_and_the_rest_listed():
    """A GPU kernel is named after its fusion with '_' for '.'; a library GEMM matches nothing and is listed by its
    kernel name."""
    index = {n: {"shape": "f32[1]", "opcode": "fusion", "root": "add", "op_name": "", "source": "a.py:1 (f)"}
             for n in ("fusion.5", "input_reduce_fusion", "command_buffer.1")}
    events = {"duration_ns": {"fusion_5": 3_000, "input_reduce_fusion": 1_000, "sm90_xmma_gemm_f32": 5_000},
              "count": collections.Counter(), "device": True}
    s = summarize(events, index, n=1)
    assert {o["name"]: o["ms"] for o in s["ops"]} == {"fusion.5": 0.003, "input_reduce_fusion": 0.001}
    assert s["unmatched"] == [{"event": "sm90_xmma_gemm_f32", "ms": 0.005}]
    assert instruction_of("fusion_5", index) == "fusion.5" and instruction_of("command_buffer_1", index) == \
        "command_buffer.1" and instruction_of("thunk", index) is None


def test_slow_reduce_flags_a_product_with_a_size_one_dimension():
    """A row sum of a product as XLA:CPU fuses it: flagged when the result keeps a dimension of size 1 (the fusion
    that runs 20-80x slower), not without one, not for a square (one operand) and not when written as a dot (its
    reduce folds the size-1 dimension away)."""
    flags = lambda f, shape: {r["slow_path"] for r in hlo_index(  # noqa: E731
        jax.jit(f).lower(jnp.ones(shape), jnp.ones(shape)).compile().as_text()).values()}
    product = lambda a, b: jnp.sum(a * b, axis=-1)  # noqa: E731
    assert "row sum" in flags(product, (1, 4, 64, 16))
    assert flags(product, (2, 4, 64, 16)) == {False}
    assert flags(lambda a, b: jnp.sum(a * a, axis=-1) + b[..., 0], (1, 4, 64, 16)) == {False}
    assert flags(lambda a, b: jnp.einsum("...d,...d->...", a, b), (1, 4, 64, 16)) == {False}
    body = ["%p.1 = f32[1,8]{1,0} parameter(0)", "%q.1 = f32[1,8]{1,0} parameter(1)",
            "%m.1 = f32[1,8]{1,0} multiply(%p.1, %q.1)", "ROOT %r.1 = f32[1]{0} reduce(%m.1, %c.1), dimensions={1}"]
    folded = body[:3] + ["ROOT %r.1 = f32[] reduce(%m.1, %c.1), dimensions={0,1}"]
    assert profile_bench.slow_reduce(body) and not profile_bench.slow_reduce(folded)
    assert not profile_bench.slow_reduce(body[:3])


def test_row_dot_flags_a_dot_contracting_the_rows_of_its_left_operand():
    """dk = dsᵀ q as autodiff writes it (a dot over the rows of both operands) is flagged; the same product from q
    transposed first (longctx.xla_cpu.rows_dot) and a plain q kᵀ are not."""
    from longctx.xla_cpu import rows_dot, transposed

    def flags(f, a, b):
        index = hlo_index(jax.jit(f).lower(a, b).compile().as_text())
        return {r["slow_path"] for r in index.values() if r["opcode"] == "dot"}

    ds, q = jnp.ones((4, 256, 128)), jnp.ones((4, 256, 64))
    assert "row dot" in flags(lambda ds, q: jnp.einsum("bqk,bqd->bkd", ds, q), ds, q)
    assert "row dot" not in flags(lambda ds, q: rows_dot(transposed(q), ds), ds, q)
    assert "row dot" not in flags(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), q, q)
    line = "%dot.1 = f32[4,64,128]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={1}"
    assert profile_bench.row_dot(line, {"a": "f32[4,256,64]{2,1,0}"})
    assert not profile_bench.row_dot(line.replace("={1}", "={2}"), {"a": "f32[4,256,64]{2,1,0}"})


@pytest.mark.parametrize("extra", [["--method", "dense:naive"], ["--method", "eva", "--forward_only"],
                                   ["--method", "dense"]])
def test_profile_writes_the_tables_trace_and_module(tmp_path, extra):
    out = tmp_path / "p"
    assert cli.main(["profile", "--out", str(out), "--length", "64", "--heads", "2", "--head_dim", "8",
                     "--calls", "2", "--warmup", "1", "--noprogress", *extra]) == 0
    res = json.loads((out / "profile.json").read_text())
    assert res["wall_ms_median"] > 0 and res["traced_op_ms_per_call"] > 0 and res["kinds"] and res["ops"]
    method = extra[1].split(":")[0]
    assert any(f"longctx/attention/{method}/" in r["source"] for r in res["sources"]), res["sources"]
    assert all(o["name"] in (out / "hlo.txt").read_text() for o in res["ops"])
    assert glob.glob(str(out / "trace" / "**" / "*.xplane.pb"), recursive=True)
    assert res["target"].startswith(f"`{extra[1]}` causal")
    assert "### By source line" in (out / "profile.md").read_text()


def test_profile_of_a_training_step(tmp_path):
    out = tmp_path / "s"
    sets = [f"--config.{s}" for s in ["model.d_model=32", "model.num_layers=1", "model.num_heads=2",
                                      "model.head_dim=16", "model.d_ff=64"]]
    assert cli.main(["profile", "--out", str(out), "--config", str(REPO / "configs" / "default.py"), *sets,
                     "--length", "32", "--batch", "2", "--window", "16", "--calls", "1", "--warmup", "0",
                     "--noprogress"]) == 0
    res = json.loads((out / "profile.json").read_text())
    assert "training step of `configs/default.py`" in res["target"] and "updates of 16 tokens" in res["target"]
    assert res["ops"]
    assert any("longctx/models/" in r["source"] for r in res["sources"])


@pytest.mark.parametrize("argv, message", [
    ([], "give exactly one of --method"),
    (["--method", "dense", "--config", "configs/default.py"], "give exactly one of --method"),
    (["--method", "dense:nosuch"], "dense offers dense:naive, dense:blockwise"),
    (["--method", "dense", "--length", "1k,2k"], "give one length"),
    (["--config", "configs/builtin/mlm_dense.py", "--length", "32"], "profiles decoder training steps"),
])
def test_profile_refuses_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--out", str(tmp_path), "--noprogress",
                  *[str(REPO / a) if a.startswith("configs/") else a for a in argv]])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_profile_is_registered():
    assert "profile" in cli.build_parser().format_help() and profile_bench.__doc__


class _Line:
    def __init__(self, name, events=()):
        self.name, self.events = name, list(events)


class _Plane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


def test_op_lines_prefer_an_accelerator_and_its_op_line():
    host = _Plane("/host:CPU", [_Line("tf_XLAEigen/1")])
    gpu = _Plane("/device:GPU:0", [_Line("Stream #1"), _Line("XLA Ops")])
    names = lambda planes: ([x.name for x in profile_bench._op_lines(planes)[0]], profile_bench._op_lines(planes)[1])  # noqa: E731
    assert names([host]) == (["tf_XLAEigen/1"], False)
    assert names([host, gpu]) == (["XLA Ops"], True)
    bare = _Plane("/device:GPU:0", [_Line("Stream #1"), _Line("Stream #2")])
    assert names([host, bare]) == (["Stream #1", "Stream #2"], True)
