"""Generated recall tasks (longctx/data/synthetic.py): rows are a pure function of (seed, step, row,
split), answers sit at the requested distances, and exactly the answer tokens are scored."""

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config, validate
from longctx.data import sources
from longctx.data.synthetic import COPY_MARKER, NEEDLE_PREFIX, RowBatcher
from longctx.errors import ConfigError

TASKS = ("mqar", "passkey", "copy")


def data_cfg(task, corpus, cache, **syn):
    c = base_config()
    c.data.source = task
    c.data.path = str(corpus)
    c.data.cache_dir = str(cache)
    for k, v in syn.items():
        c.data.synthetic[k] = v
    return ml_collections.ConfigDict(c.data.to_dict())


@pytest.fixture
def make(tiny_corpus, tmp_path):
    return lambda task, **syn: sources.build(data_cfg(task, tiny_corpus, tmp_path / "cache", **syn))


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_a_pure_function_of_seed_step_row(make, task):
    src = make(task)
    a = src.rows(seed=3, step=7, rows=[0, 1, 2, 3], row_len=96)
    b = src.rows(seed=3, step=7, rows=[2], row_len=96)  # row 2 alone, another batch size
    c = make(task).rows(seed=3, step=7, rows=[0, 1, 2, 3], row_len=96)  # a fresh source (a resumed run)
    for k in a:
        np.testing.assert_array_equal(a[k][2], b[k][0])
        np.testing.assert_array_equal(a[k], c[k])
    assert not np.array_equal(a["tokens"][0], src.rows(seed=3, step=8, rows=[0], row_len=96)["tokens"][0])
    assert not np.array_equal(a["tokens"][0], src.rows(seed=4, step=7, rows=[0], row_len=96)["tokens"][0])
    assert not np.array_equal(a["tokens"][0], src.rows(seed=3, step=7, rows=[0], row_len=96, split="valid")["tokens"][0])
    assert a["tokens"].shape == (4, 97) and a["tokens"].dtype == np.int32
    assert a["tokens"].min() >= 0 and a["tokens"].max() < 256


@pytest.mark.parametrize("task", TASKS)
def test_host_shards_are_slices_of_the_global_batch(make, task):
    src = make(task)
    full = RowBatcher(src, row_len=64, batch_size=6, seed=1).batch(5)
    halves = [RowBatcher(src, row_len=64, batch_size=6, seed=1, shard=(i, 2)).batch(5) for i in range(2)]
    for k in ("tokens", "weights"):
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), full[k])


def answers_of(batch, b):
    """(first target index, length, distance) of row b's answers, from the packed arrays."""
    out = []
    for i, d in enumerate(batch["distance"][b]):
        if d < 0:
            continue
        where = np.flatnonzero(batch["answer"][b] == i)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
        out.append((int(where[0]), len(where), int(d)))
    return out


@pytest.mark.parametrize("task", TASKS)
def test_exactly_the_answer_tokens_are_scored(make, task):
    batch = make(task).rows(seed=0, step=0, rows=range(8), row_len=128)
    for b in range(8):
        ans = answers_of(batch, b)
        scored = np.zeros(128, bool)
        for t, n, _ in ans:
            scored[t : t + n] = True
        np.testing.assert_array_equal(batch["weights"][b] == 1.0, scored)
        assert set(np.unique(batch["weights"][b])) <= {0.0, 1.0}
    n_ans = {"mqar": 16, "passkey": 1, "copy": 1}[task]
    n_tok = {"mqar": 1, "passkey": 5, "copy": 8}[task]
    assert batch["weights"].sum() == 8 * n_ans * n_tok


@pytest.mark.parametrize("task", ["passkey", "copy"])
def test_answers_at_the_requested_distances(make, task):
    src = make(task)
    lo, hi = src.distance_range(200)
    want = np.array([lo, hi, (lo + hi) // 2, lo + 1, hi - 1, 57])
    batch = src.rows(seed=0, step=2, rows=range(len(want)), row_len=200, distances=want)
    for b, d in enumerate(want):
        (t, n, dist), = answers_of(batch, b)
        assert dist == d
        toks = batch["tokens"][b]
        answer = toks[t + 1 : t + 1 + n]  # target t is token t + 1
        np.testing.assert_array_equal(toks[t + 1 - d : t + 1 - d + n], answer)  # the earlier copy, d back
        assert t + n == 200  # the answer closes the row
        if task == "passkey":
            assert bytes(toks[t + 1 - d - len(NEEDLE_PREFIX) : t + 1 - d].astype(np.uint8)) == NEEDLE_PREFIX
            assert bytes(toks[t + 1 - len(NEEDLE_PREFIX) : t + 1].astype(np.uint8)) == NEEDLE_PREFIX
            assert all(48 <= x <= 57 for x in answer)
        else:
            assert toks[t] == COPY_MARKER and (answer < 64).all()
            others = np.ones(201, bool)
            others[t + 1 - d : t + 1 - d + n] = others[t + 1 :] = others[t] = False
            assert (toks[others] >= 64).all()  # filler never looks like the segment


def test_training_distances_stay_in_the_configured_range(make):
    src = make("copy", distance=(20, 30))
    batch = src.rows(seed=0, step=0, rows=range(64), row_len=128)
    d = batch["distance"][:, 0]
    assert d.min() >= 20 and d.max() <= 30 and len(set(d.tolist())) > 5
    with pytest.raises(ConfigError, match="does not fit"):
        make("copy", distance=(20, 500)).rows(seed=0, step=0, rows=[0], row_len=128)


def test_mqar_values_follow_their_keys_at_the_measured_distance(make):
    src = make("mqar", num_pairs=6, num_keys=16, num_values=16)
    batch = src.rows(seed=0, step=0, rows=range(4), row_len=64)
    for b in range(4):
        toks = batch["tokens"][b]
        pairs = dict(zip(toks[0:12:2].tolist(), toks[1:12:2].tolist()))
        assert len(pairs) == 6 and all(k < 16 <= v < 32 for k, v in pairs.items())
        assert (toks[12:][~np.isin(np.arange(12, 65), [t + i for t, _, _ in answers_of(batch, b) for i in (0, 1)])]
                >= 32).all()  # filler ids above keys and values
        ans = answers_of(batch, b)
        assert len(ans) == 6 and len({toks[t] for t, _, _ in ans}) == 6  # every key queried once
        for t, n, d in ans:
            assert n == 1 and toks[t + 1] == pairs[int(toks[t])]  # the query key, then its value
            assert toks[t + 1 - d] == toks[t + 1] and toks[t - d] == toks[t]  # d back: the same pair


def test_evaluation_rows_spread_over_the_bins(make):
    src = make("passkey")
    rows, edges = src.eval_rows(row_len=300, n_rows=40, bins=4, split="valid", seed=9)
    lo, hi = src.distance_range(300)
    assert edges[0] == lo and edges[-1] == hi + 1 and len(edges) == 5
    counts = np.histogram(rows["distance"][:, 0], bins=edges)[0]
    assert counts.tolist() == [10, 10, 10, 10]
    again, _ = src.eval_rows(row_len=300, n_rows=40, bins=4, split="valid", seed=9)
    np.testing.assert_array_equal(rows["tokens"], again["tokens"])


def test_config_errors_are_one_line(tiny_corpus, tmp_path):
    def cfg(task, **kw):
        c = base_config()
        c.data.source = task
        c.data.path = str(tiny_corpus)
        c.train.seq_len = 64
        for k, v in kw.items():
            c.data.synthetic[k] = v
        return c

    validate(cfg("mqar"))
    with pytest.raises(ConfigError, match="query slots"):
        validate(cfg("mqar", num_pairs=30, num_keys=40))
    with pytest.raises(ConfigError, match="num_pairs"):
        validate(cfg("mqar", num_pairs=20, num_keys=10))
    with pytest.raises(ConfigError, match="filler"):
        validate(cfg("mqar", num_keys=128, num_values=128))
    with pytest.raises(ConfigError, match="copy_vocab"):
        validate(cfg("copy", copy_vocab=255))
    c = cfg("mqar")
    c.model.kind = "encoder"
    with pytest.raises(ConfigError, match="decoder"):
        validate(c)
