"""Packed recall examples (``data.packing='segments'`` with ``data.synthetic.example_len``): a training row holds
several independent examples back to back with segment ids and positions restarting at each, the answers (and only
they) scored, every answer recalled from inside its own example; the configurations that cannot pack are refused
in one line."""

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config, validate
from longctx.data import sources
from longctx.data.synthetic import MQARSource, RowBatcher
from longctx.errors import ConfigError
from tests.data.test_recall import TASKS, answers_of


def packed_cfg(task, corpus, cache, example_len, **syn):
    c = base_config()
    c.data.source, c.data.packing = task, "segments"
    c.data.path, c.data.cache_dir = str(corpus), str(cache)
    c.data.synthetic.example_len = example_len
    for k, v in syn.items():
        c.data.synthetic[k] = v
    return c


@pytest.fixture
def make(tiny_corpus, tmp_path):
    def build(task, example_len, **syn):
        c = packed_cfg(task, tiny_corpus, tmp_path / "cache", example_len, **syn)
        return sources.build(ml_collections.ConfigDict(c.data.to_dict()))
    return build


@pytest.mark.parametrize("task", TASKS)
def test_packed_rows_hold_independent_examples(make, task):
    """Rows of 200 inputs, examples of at least 60: 3 examples of 67 tokens; segment ids / positions restart at each;
    each answer and the token it is recalled from lie in the same example; exactly the answers are scored."""
    src = make(task, 60)
    batch = src.packed_rows(seed=1, step=2, rows=range(4), row_len=200)
    assert src.example_lengths(200).tolist() == [67, 67, 67]
    seg, pos = batch["segment_ids"], batch["positions"]
    assert seg.shape == pos.shape == batch["tokens"].shape == (4, 201) and seg.dtype == pos.dtype == np.int32
    np.testing.assert_array_equal(seg[0], np.repeat([1, 2, 3], 67))
    np.testing.assert_array_equal(pos[0], np.tile(np.arange(67), 3))
    per_example = {"mqar": 16, "passkey": 1, "copy": 1}[task]
    for b in range(4):
        ans = answers_of(batch, b)
        assert len(ans) == 3 * per_example
        scored = np.zeros(200, bool)
        for t, n, d in ans:
            scored[t : t + n] = True
            example = seg[b, t + 1]  # target t is token t + 1
            assert (seg[b, t + 1 : t + 1 + n] == example).all()  # the answer inside one example
            assert seg[b, t + 1 - d] == example  # the token it is recalled from: the same example
            np.testing.assert_array_equal(batch["tokens"][b, t + 1 - d], batch["tokens"][b, t + 1])
        np.testing.assert_array_equal(batch["weights"][b] == 1.0, scored)
        assert not scored[seg[b, 1:] != seg[b, :-1]].any()  # no target that opens the next example is scored
    # an example is what one row of its length is: the first example of a row is the unpacked row of 66 inputs
    alone = src.rows(seed=1, step=2, rows=[0], row_len=66)["tokens"][0]
    np.testing.assert_array_equal(batch["tokens"][0, :67], alone)


def test_uneven_rows_share_the_tokens_evenly(make):
    src = make("mqar", 20, num_pairs=4, num_keys=16, num_values=16)
    lengths = src.example_lengths(64)  # 65 tokens, 3 examples of at least 21
    assert lengths.tolist() == [22, 22, 21] and lengths.sum() == 65
    batch = src.packed_rows(seed=0, step=0, rows=[0], row_len=64)
    np.testing.assert_array_equal(batch["positions"][0], np.concatenate([np.arange(n) for n in lengths]))
    assert len(answers_of(batch, 0)) == 12


def test_packed_batches_are_a_pure_function_and_shard_by_rows(make):
    src = make("copy", 30)
    full = RowBatcher(src, row_len=127, batch_size=6, seed=1).batch(5)
    assert set(full) == {"tokens", "weights", "segment_ids", "positions"}
    halves = [RowBatcher(make("copy", 30), row_len=127, batch_size=6, seed=1, shard=(i, 2)).batch(5) for i in range(2)]
    for k in full:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), full[k])
    assert not np.array_equal(full["tokens"], RowBatcher(src, row_len=127, batch_size=6, seed=1).batch(6)["tokens"])


def test_packing_configurations_are_checked_in_one_line(tiny_corpus, tmp_path):
    def cfg(example_len, packing="segments", task="mqar", seq_len=64, **syn):
        c = packed_cfg(task, tiny_corpus, tmp_path / "cache", example_len, num_pairs=4, **syn)
        c.data.packing = packing
        c.train.seq_len = seq_len
        return c

    validate(cfg(20))
    validate(cfg(16, task="copy", copy_len=4))
    with pytest.raises(ConfigError, match=r"^data.packing='segments' applies to prepared corpora and packed recall "
                                          r"examples; data.source='mqar' generates whole rows: set data.synthetic."
                                          r"example_len .*$"):
        validate(cfg(0))
    with pytest.raises(ConfigError, match=r"^data.synthetic.example_len=20 packs examples into rows with "
                                          r"data.packing='segments'"):
        validate(cfg(20, packing="document"))
    with pytest.raises(ConfigError, match=r"^data.synthetic.example_len=40: rows of 64 inputs hold 1 example"):
        validate(cfg(40))
    with pytest.raises(ConfigError, match="query slots"):  # an example too short for the task
        validate(cfg(8))
    with pytest.raises(ConfigError, match="must be >= 0"):
        validate(cfg(-1))


def test_a_generated_source_without_examples_refuses_packing(tiny_corpus, tmp_path, monkeypatch):
    c = packed_cfg("mqar", tiny_corpus, tmp_path / "cache", 20, num_pairs=4)
    c.train.seq_len = 64
    monkeypatch.setattr(MQARSource, "packs_examples", False)
    with pytest.raises(ConfigError, match=r"^data.packing='segments' .* generates whole rows: it has no examples to "
                                          r"keep apart, or leave data.packing at its default$"):
        validate(c)
