"""``longctx-fill``'s choice of ids: the run's own mask id (as training resolves it), and fills drawn only from the
tokenizer's text ids, wherever the mask id and the special tokens sit in the vocabulary."""

import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.data import masking
from longctx.data.tokenizers import ByteTokenizer
from longctx.fill import fill_bytes, masked_bytes


class FixedEncoder(nnx.Module):
    """Logits that prefer id ``NOT_TEXT`` most, then byte ``b'x'`` where the input is ``mask_id``, then byte ``b'y'``
    (so a fill shows which id the masked bytes were given, and that no id beyond the bytes is chosen)."""

    NOT_TEXT = 280  # above the bytes, below the mask id of the first case

    def __init__(self, vocab_size: int, mask_id: int):
        table = np.zeros(vocab_size, np.float32)
        table[self.NOT_TEXT], table[ord("y")] = 30.0, 2.0
        self.table = nnx.Param(jnp.asarray(table))
        self.x = nnx.Param(jnp.asarray(np.eye(vocab_size, dtype=np.float32)[ord("x")] * 20.0))
        self.mask_id = mask_id

    def __call__(self, ids, important, deterministic=True):
        at_mask = (ids == self.mask_id)[..., None]
        return self.table[...] + jnp.where(at_mask, self.x[...], 0.0), None


def _runner(mask_id: int, vocab_size: int, expect_mask: int):
    c = config_lib.base_config()
    c.model.kind = "encoder"
    c.model.vocab_size = vocab_size
    c.mlm.mask_id = mask_id
    c.train.seq_len = 16
    graphdef, state = nnx.split(FixedEncoder(vocab_size, expect_mask))
    return SimpleNamespace(cfg=config_lib.validate(c), tokenizer=ByteTokenizer(), graphdef=graphdef,
                           params=(state,))


@pytest.mark.parametrize("mask_id, vocab_size, expect_mask", [
    (300, 512, 300),  # a mask id above the bytes with ids between (256..299) that are no byte
    (-1, 512, 256),  # a config saved unresolved (an import): the mask id training would use, one beyond the bytes
])
def test_fill_gives_the_runs_mask_id_and_fills_only_text_bytes(mask_id, vocab_size, expect_mask):
    data, mask = masked_bytes("a_b_c")
    filled, passes = fill_bytes(_runner(mask_id, vocab_size, expect_mask), data, mask)
    assert (filled, passes) == (b"axbxc", 2)


def _bert_like_tokenizer(path, V=120):
    tokenizers = pytest.importorskip("tokenizers")
    from longctx.data.hf import HFTokenizer

    special = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    words = [i for i in range(V) if i not in special.values()]
    vocab = {**special, **{f"w{i}": i for i in words}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(special))
    tok.save(str(path))
    assert json.loads(path.read_text())["model"]["vocab"]["[MASK]"] == 103
    return HFTokenizer(str(path)), special


def test_text_ids_exclude_exactly_the_special_ids_wherever_the_mask_is(tmp_path):
    tok, special = _bert_like_tokenizer(tmp_path / "tokenizer.json")
    assert masking.own_mask_id(tok) == 103 and masking.special_ids(tok) == tuple(sorted(special.values()))
    ok = masking.text_ids(tok, 103, 128)  # a table of 128 rows over a tokenizer of 120 ids
    assert np.flatnonzero(~ok).tolist() == [0, 100, 101, 102, 103, *range(120, 128)]
    # bytes: every byte is text, the mask id and any id beyond the bytes are not
    ok = masking.text_ids(ByteTokenizer(), 256, 300)
    assert ok[:256].all() and not ok[256:].any()
