"""MLM masking: a pure function of (seed, step, row) with an exact count per row, BERT's 80/10/10,
spans that are contiguous and clusters that are concentrated; the same after a restart."""

import json
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config
from longctx.data.masking import SCHEMES, mask_rows, num_masked

ROOT = Path(__file__).resolve().parents[2]
MASK_ID = 256


def mcfg(**kw):
    c = ml_collections.ConfigDict(base_config().mlm.to_dict())
    for k, v in kw.items():
        c[k] = v
    return c


def tokens(B=4, T=256, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(B, T)).astype(np.int32)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 7, 64, 256])
def test_exact_count_and_unmasked_inputs_unchanged(scheme, T):
    tok = tokens(6, T)
    out = mask_rows(tok, mcfg(masking=scheme), seed=3, step=5, rows=np.arange(6), mask_id=MASK_ID)
    assert (out["mask"].sum(1) == num_masked(T, 0.15)).all()
    np.testing.assert_array_equal(out["targets"], tok)
    np.testing.assert_array_equal(out["inputs"][~out["mask"]], tok[~out["mask"]])
    assert out["inputs"].max() <= MASK_ID and out["targets"].max() < MASK_ID


@pytest.mark.parametrize("scheme", SCHEMES)
def test_masks_depend_only_on_seed_step_row(scheme):
    tok = tokens(4)
    c = mcfg(masking=scheme)
    a = mask_rows(tok, c, seed=1, step=7, rows=np.arange(4), mask_id=MASK_ID)
    b = mask_rows(tok, c, seed=1, step=7, rows=np.arange(4), mask_id=MASK_ID)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    # rows 2, 3 alone (another host's shard, another batch size) get the same masks
    part = mask_rows(tok[2:], c, seed=1, step=7, rows=np.array([2, 3]), mask_id=MASK_ID)
    np.testing.assert_array_equal(part["mask"], a["mask"][2:])
    np.testing.assert_array_equal(part["inputs"], a["inputs"][2:])
    # another step, seed or row index draws other masks
    for other in (dict(seed=1, step=8, rows=np.arange(4)), dict(seed=2, step=7, rows=np.arange(4)),
                  dict(seed=1, step=7, rows=np.arange(4) + 4)):
        assert not np.array_equal(mask_rows(tok, c, mask_id=MASK_ID, **other)["mask"], a["mask"])


def test_same_masks_after_a_restart():
    """A fresh interpreter (a resumed run) draws exactly the masks of this one for the same (seed, step)."""
    tok = tokens(3, 128)
    script = (
        "import json, numpy as np, ml_collections\n"
        "from longctx.config import base_config\n"
        "from longctx.data.masking import mask_rows\n"
        f"tok = np.array({tok.tolist()}, np.int32)\n"
        "out = {}\n"
        "for scheme in ('bert', 'span', 'clustered'):\n"
        "    c = ml_collections.ConfigDict(base_config().mlm.to_dict()); c.masking = scheme\n"
        "    r = mask_rows(tok, c, seed=11, step=42, rows=np.arange(3), mask_id=256)\n"
        "    out[scheme] = [r['inputs'].tolist(), r['mask'].tolist()]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    for scheme in SCHEMES:
        here = mask_rows(tok, mcfg(masking=scheme), seed=11, step=42, rows=np.arange(3), mask_id=MASK_ID)
        assert fresh[scheme] == [here["inputs"].tolist(), here["mask"].tolist()]


def test_80_10_10():
    tok = tokens(400)
    out = mask_rows(tok, mcfg(), seed=0, step=0, rows=np.arange(400), mask_id=MASK_ID)
    m = out["mask"]
    to_mask = np.mean(out["inputs"][m] == MASK_ID)
    same = np.mean(out["inputs"][m] == tok[m])  # includes random draws that hit the same byte (1/256)
    assert abs(to_mask - 0.8) < 0.02 and abs(same - 0.1) < 0.02, (to_mask, same)
    none = mask_rows(tok, mcfg(mask_prob=0.0, random_prob=0.0), seed=0, step=0, rows=np.arange(400), mask_id=MASK_ID)
    np.testing.assert_array_equal(none["inputs"], tok)
    all_mask = mask_rows(tok, mcfg(mask_prob=1.0, random_prob=0.0), seed=0, step=0, rows=np.arange(400),
                         mask_id=MASK_ID)
    assert (all_mask["inputs"][all_mask["mask"]] == MASK_ID).all()


def _run_lengths(mask_row):
    padded = np.concatenate([[0], mask_row.astype(int), [0]])
    d = np.diff(padded)
    return np.flatnonzero(d == -1) - np.flatnonzero(d == 1)


def test_spans_are_contiguous_and_bert_is_not():
    tok = tokens(64, 512)
    mean_run = {}
    for scheme in ("bert", "span"):
        out = mask_rows(tok, mcfg(masking=scheme, span_len=4.0, max_span_len=10), seed=0, step=0, rows=np.arange(64),
                        mask_id=MASK_ID)
        runs = np.concatenate([_run_lengths(r) for r in out["mask"]])
        mean_run[scheme] = runs.mean()
    assert mean_run["bert"] < 1.4 and 3.0 < mean_run["span"] < 6.0, mean_run


def test_clusters_are_concentrated():
    tok = tokens(64, 256)
    spread = {}
    for scheme, kw in (("bert", {}), ("clustered", dict(clusters=(1, 1), cluster_sigma=(6.0, 6.0)))):
        out = mask_rows(tok, mcfg(masking=scheme, **kw), seed=0, step=0, rows=np.arange(64), mask_id=MASK_ID)
        spread[scheme] = np.median([np.std(np.flatnonzero(r)) for r in out["mask"]])
    # one centre of width 6: the 38 positions sit within a few sigma; uniform ones spread over the row
    assert spread["clustered"] < 20 < 50 < spread["bert"], spread


def _old_draw(tok, c, *, seed, step, rows, mask_id):
    """The inputs as drawn before the replacement ids were the vocabulary less the special ids: the random tokens
    ``rng.integers(0, mask_id)`` after the positions and the 80/10/10 draw, from the same per-row stream."""
    from longctx.data.masking import choose_positions, row_rng

    out = np.array(tok, np.int32, copy=True)
    for b, r in enumerate(rows):
        rng = row_rng(seed, step, int(r))
        pos = choose_positions(rng, tok.shape[1], c)
        u = rng.random(len(pos))
        out[b, pos[u < c.mask_prob]] = mask_id
        to_random = pos[(u >= c.mask_prob) & (u < c.mask_prob + c.random_prob)]
        out[b, to_random] = rng.integers(0, mask_id, size=len(to_random))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_byte_default_draws_the_rows_it_drew_before(scheme):
    """Bytes: mask id 256 (the last id), vocabulary 256, no special id: the same replacement set as the ids below
    the mask id, so the same rng stream gives bit-identical rows, with or without the vocabulary passed."""
    tok = tokens(32, 128)
    c = mcfg(masking=scheme, random_prob=0.3)  # more random draws than 10 %: more to compare
    old = _old_draw(tok, c, seed=5, step=9, rows=np.arange(32), mask_id=MASK_ID)
    for kw in ({}, dict(vocab_size=256), dict(vocab_size=256, special_ids=())):
        new = mask_rows(tok, c, seed=5, step=9, rows=np.arange(32), mask_id=MASK_ID, **kw)
        np.testing.assert_array_equal(new["inputs"], old)
    assert ((old != tok) & (old != MASK_ID)).sum() > 100  # random replacements were compared


def test_bert_layout_draws_the_whole_vocabulary_less_its_special_ids():
    """BERT's layout: [MASK] = 103 of 30522, special ids [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103. Random
    replacements come from the whole vocabulary (mostly above the mask id), never a special id."""
    from longctx.data.masking import replacement_ids

    V, mask, special = 30522, 103, (0, 100, 101, 102, 103)
    ids = replacement_ids(mask, V, special)
    assert len(ids) == V - len(special) and not set(special) & set(ids.tolist())
    tok = np.random.default_rng(0).integers(1000, 2000, size=(64, 256)).astype(np.int32)  # no special id in the text
    c = mcfg(mask_prob=0.0, random_prob=1.0)  # every predicted position gets a random token
    out = mask_rows(tok, c, seed=0, step=0, rows=np.arange(64), mask_id=mask, vocab_size=V, special_ids=special)
    drawn = out["inputs"][out["mask"]]
    assert len(drawn) == 64 * num_masked(256, c.rate)
    assert not np.isin(drawn, special).any() and drawn.max() < V and drawn.min() >= 0
    assert np.mean(drawn > mask) > 0.98  # uniform over 30517 ids: 1 - 99/30517 above the mask id
    assert np.mean(drawn >= V // 2) > 0.4  # the upper half of the vocabulary too, not only the first ids
    # the ids below the mask id are drawn too (not only those above it), specials still excluded
    low = mask_rows(tok, c, seed=0, step=0, rows=np.arange(64), mask_id=mask, vocab_size=120, special_ids=special)
    drawn = low["inputs"][low["mask"]]
    assert set(np.unique(drawn).tolist()) == set(range(120)) - set(special)


def test_replacement_vocab_of_a_tokenizer(tmp_path):
    """What the training task and the evaluation pass to mask_rows: the byte tokenizer's 256 ids and no special
    id (the draws of the ids below mask id 256), a tokenizer file's vocabulary and its special tokens."""
    import tokenizers

    from longctx.data.hf import HFTokenizer
    from longctx.data.masking import replacement_vocab
    from longctx.data.tokenizers import build

    assert replacement_vocab(build("bytes")) == {"vocab_size": 256, "special_ids": ()}
    assert replacement_vocab(None) == {}
    special = {"[PAD]": 0, "[UNK]": 7, "[CLS]": 8, "[SEP]": 9, "[MASK]": 10}
    vocab = {**special, **{f"w{i}": i for i in range(20) if i not in special.values()}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(special))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert replacement_vocab(hf) == {"vocab_size": 20, "special_ids": (0, 7, 8, 9, 10)}
