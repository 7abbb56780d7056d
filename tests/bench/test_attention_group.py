"""``longctx-bench attention --group``: a stack of cores timed beside the all-exact stack of the same depth, on tiny
lengths. No timing assertions: the rows, the ratios' reference, the chaining of the layers, one-line errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from longctx.bench import attention_bench as ab
from longctx.bench import cli
from longctx.bench import common as C
from longctx.errors import ConfigError


def test_group_rows_and_the_exact_reference(tmp_path):
    out = tmp_path / "out"
    assert cli.main(["attention", "--group", "eva,dense", "--lengths", "64,128", "--causal", "--repeats", "1",
                     "--warmup", "0", "--heads", "2", "--head_dim", "16", "--out", str(out), "--noprogress"]) == 0
    res = json.loads((out / "attention_group.json").read_text())
    assert [(r["group"], r["length"]) for r in res["rows"]] == [
        ("dense,dense", 64), ("dense,dense", 128), ("eva,dense", 64), ("eva,dense", 128)]
    for r in res["rows"]:
        assert r["direction"] == "causal" and r["fwd_status"] == r["fwdbwd_status"] == "ok"
        assert r["fwd_s"] > 0 and r["fwdbwd_s"] > 0
    ref = [r for r in res["rows"] if r["group"] == "dense,dense"]
    assert all(r["fwd_vs_exact"] == 1.0 and r["fwdbwd_vs_exact"] == 1.0 for r in ref)
    hyb = res["rows"][2]
    assert hyb["fwdbwd_vs_exact"] == pytest.approx(hyb["fwdbwd_s"] / ref[0]["fwdbwd_s"])
    md = (out / "attention_group.md").read_text()
    assert "`eva,dense`" in md and "--group eva,dense" in md
    assert not (out / "attention.json").exists()  # --group writes its own files only


@pytest.mark.parametrize("remat", [False, True])
def test_each_layer_reads_the_previous_layers_output(remat):
    params, rest, fwd, grads = ab.group_fns(["eva", "dense", "dense"], heads=2, head_dim=8, causal=True, seed=0,
                                            remat=remat)
    assert [type(r).__name__ for r in rest] and len(params) == 3
    qkvs = [C.random_qkv(i, 1, 2, 32, 8) for i in range(3)]
    w = jax.random.normal(jax.random.key(1), (1, 2, 32, 8))
    _, gq = jax.jit(grads)(params, rest, qkvs, w, jax.random.key(2))
    for q, _k, v in gq:  # the first layer's inputs reach the loss only through the later layers
        assert float(np.abs(np.asarray(q)).sum()) > 0 and float(np.abs(np.asarray(v)).sum()) > 0
    y = jax.jit(fwd)(params, rest, qkvs)
    qkvs2 = [tuple(x + 1.0 for x in qkvs[0])] + qkvs[1:]
    assert not np.allclose(np.asarray(y), np.asarray(jax.jit(fwd)(params, rest, qkvs2)))


@pytest.mark.parametrize("group,msg", [
    ("eva,,dense", "comma list of methods"),
    ("eva,nosuch", "unknown method 'nosuch'"),
])
def test_bad_group_is_one_line(group, msg):
    with pytest.raises(ConfigError, match=msg):
        cli.parse_args(["attention", "--group", group])


def test_unknown_variant_is_one_line():
    with pytest.raises(ConfigError, match="not a variant of dense"):
        ab._group_layer("dense:nosuch")
