"""WikiText-103 source: <eos> per line, article documents, vocabulary rules, counts, ppl."""

import math

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config
from longctx.data import sources, tokenizers, wikitext103, wordvocab
from longctx.data.prepare import prepare
from longctx.errors import ConfigError, DataError
from longctx.protocols import summarize

TRAIN = (
    " \n"
    " = Valkyria Chronicles = \n"
    " \n"
    " The game began development in 2010 , carrying over a large portion of the work . \n"
    " \n"
    " = = Gameplay = = \n"
    " \n"
    " The game 's battle system , the <unk> system , is carried over . \n"
    " \n"
    " = Tropical Storm = \n"
    " \n"
    " The storm was 1 @,@ 000 miles long and 3 @.@ 5 @-@ day in the game . \n"
)
# as in the real data, every valid/test word is a train word (rare words are already <unk>)
VALID = " \n = Tropical Storm = \n \n The storm was a large <unk> . \n"
TEST = " \n = Valkyria Chronicles = \n \n The game was carried over . \n \n The work , the storm . \n"


def hand_count(text):
    lines = text.split("\n")[:-1]
    return sum(len(ln.split()) + 1 for ln in lines)


def write_wt(root, train=TRAIN, valid=VALID, test=TEST, ext="tokens"):
    root.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (root / f"wiki.{split}.{ext}").write_text(text, encoding="utf-8")
    return root


def data_cfg(path, cache, tokenizer="words", **options):
    c = base_config().data
    c.source = "wikitext103"
    c.tokenizer = tokenizer
    c.path = str(path)
    c.cache_dir = str(cache)
    for k, v in options.items():
        c.options[k] = v
    return ml_collections.ConfigDict(c.to_dict())


def test_hand_counts_of_the_fixture():
    # train: 12 lines (6 blank); words 4 + 16 + 5 + 14 + 4 + 18 = 61, plus 12 <eos>
    assert hand_count(TRAIN) == 73
    assert hand_count(VALID) == 4 + 7 + 4
    assert hand_count(TEST) == 4 + 6 + 6 + 6


def test_eos_per_line_including_empty_lines(tmp_path):
    write_wt(tmp_path / "wt")
    tok, out, directory = prepare(data_cfg(tmp_path / "wt", tmp_path / "cache"), progress=False)
    assert tok.name == "words" and np.dtype(tok.dtype) == np.uint32
    for split, text in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        assert out[split].num_tokens == hand_count(text)
        ids = np.asarray(out[split].tokens)
        assert int((ids == 0).sum()) == text.count("\n")  # one <eos> (id 0) per line
        assert tok.decode(ids) == "\n".join(" ".join(ln.split()) for ln in text.split("\n"))
    assert out["test"].manifest["source"]["word_counts"] == {"train": 73, "valid": 15, "test": 22}
    assert out["test"].manifest["source"]["real"] is False
    assert (directory / "vocab.txt").is_file()


def test_vocabulary_rules(tmp_path):
    write_wt(tmp_path / "wt")
    tok, _, directory = prepare(data_cfg(tmp_path / "wt", tmp_path / "cache"), ["valid"], progress=False)
    words = (directory / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert words == tok.words
    assert words[0] == "<eos>"
    train_types = {w for ln in TRAIN.split("\n") for w in ln.split()}
    assert set(words[1:]) == train_types and len(words) == len(train_types) + 1
    # ordering: count descending, ties by first occurrence in train
    counts = {w: TRAIN.split().count(w) for w in train_types}
    first = {w: TRAIN.split().index(w) for w in train_types}
    assert words[1:] == sorted(train_types, key=lambda w: (-counts[w], first[w]))
    assert words[1:4] == ["=", "The", "game"]  # 8, 3, 3 occurrences; "The" appears before "game"
    assert "<unk>" in words and "@-@" in words and "@,@" in words
    # valid/test words outside the train vocabulary become <unk>
    ids = tok.encode("Robert poet\n")
    assert ids.tolist() == [tok.index["<unk>"], tok.index["<unk>"], 0]


def test_vocabulary_is_saved_and_reused(tmp_path):
    write_wt(tmp_path / "wt")
    cfg = data_cfg(tmp_path / "wt", tmp_path / "cache")
    _, _, directory = prepare(cfg, ["train"], progress=False)
    vocab = directory / "vocab.txt"
    stamp = vocab.stat().st_mtime_ns
    tok, _, _ = prepare(cfg, ["train", "test"], progress=False)
    assert vocab.stat().st_mtime_ns == stamp
    assert tokenizers.build("words", vocab_path=vocab).words == tok.words


def test_articles_are_documents_and_concatenate_to_the_stream(tmp_path):
    write_wt(tmp_path / "wt")
    src = wikitext103.WikiText103Source(path=str(tmp_path / "wt"))
    docs = list(src.documents("train"))
    assert len(docs) == 2
    assert "".join(text for _, text in docs) == TRAIN
    assert docs[1][1].startswith(" \n = Tropical Storm = \n")
    assert " = = Gameplay = = " in docs[0][1]  # sections do not start documents
    _, out, _ = prepare(data_cfg(tmp_path / "wt", tmp_path / "cache"), ["train"], progress=False)
    assert out["train"].num_docs == 2 and out["train"].doc_starts.tolist() == [0, 4 + 16 + 5 + 14 + 8, 73]  # lines 1-8: 39 words + 8 <eos>


def test_raw_files_and_txl_renamed_files(tmp_path):
    write_wt(tmp_path / "wt-raw" / "wikitext-103-raw", ext="raw")
    _, out, _ = prepare(data_cfg(tmp_path / "wt-raw", tmp_path / "cache", raw=True), ["test"], progress=False)
    assert out["test"].num_tokens == hand_count(TEST)
    txl = tmp_path / "txl"
    txl.mkdir()
    for split, text in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        (txl / f"{split}.txt").write_text(text)
    assert wikitext103.WikiText103Source(path=str(txl)).files["test"] == txl / "test.txt"


def test_bytes_tokenizer_on_wikitext_uses_word_counts(tmp_path):
    write_wt(tmp_path / "wt")
    tok, out, _ = prepare(data_cfg(tmp_path / "wt", tmp_path / "cache", tokenizer="bytes"), ["test"], progress=False)
    assert out["test"].num_tokens == len(TEST.encode())
    assert out["test"].manifest["source"]["word_counts"]["test"] == 22


def test_missing_files_name_the_expected_layout(tmp_path):
    write_wt(tmp_path / "wt")
    (tmp_path / "wt" / "wiki.valid.tokens").unlink()
    with pytest.raises(DataError) as e:
        sources.build(data_cfg(tmp_path / "wt", tmp_path / "cache"))
    assert "wiki.valid.tokens" in str(e.value) and "wikitext-103-v1.zip" in str(e.value)
    with pytest.raises(DataError, match="wikitext-103-raw-v1.zip"):
        wikitext103.WikiText103Source(path=str(tmp_path / "wt"), raw=True)


def test_real_files_are_checked_against_official_counts(tmp_path, monkeypatch):
    """A fixture whose line counts equal the 'official' ones is treated as the real data set."""
    write_wt(tmp_path / "wt")
    lines = {s: t.count("\n") for s, t in (("train", TRAIN), ("valid", VALID), ("test", TEST))}
    monkeypatch.setattr(wikitext103, "LINES", lines)
    monkeypatch.setattr(wikitext103, "TOKENS", {"train": 73, "valid": 15, "test": 23})  # test is off by one
    monkeypatch.setattr(wikitext103, "VOCAB_SIZE", 41)
    cfg = data_cfg(tmp_path / "wt", tmp_path / "cache")
    with pytest.raises(DataError, match="expected 41"):  # vocab size check (fixture has fewer types)
        prepare(cfg, ["train"], progress=False)
    n_vocab = 1 + len({w for ln in TRAIN.split("\n") for w in ln.split()})
    monkeypatch.setattr(wikitext103, "VOCAB_SIZE", n_vocab)
    tok, out, directory = prepare(cfg, ["train", "valid"], progress=False)
    assert out["valid"].manifest["source"]["real"] and out["valid"].manifest["source"]["word_counts"]["test"] == 23
    with pytest.raises(DataError, match="expected 23"):
        prepare(cfg, ["test"], progress=False)
    assert not (directory / "test.json").exists()  # nothing that looks complete
    cfg.options.verify = False
    _, out, _ = prepare(cfg, ["test"], progress=False)
    assert out["test"].num_tokens == 22


def test_words_tokenizer_needs_the_source_vocabulary():
    with pytest.raises(ConfigError, match="wikitext103"):
        tokenizers.build("words")


def test_prompt_without_newline_gets_no_eos():
    tok = wordvocab.WordTokenizer(words=["<eos>", "a", "b", "<unk>"])
    assert tok.encode("a b").tolist() == [1, 2]
    assert tok.encode("a\n\nb zz\n").tolist() == [1, 0, 0, 2, 3, 0]
    assert tok.decode([1, 0, 0, 2]) == "a\n\nb"


def test_word_level_perplexity_arithmetic():
    # 245,569 test tokens (words + <eos>) at 3.0 nats each: ppl = e^3
    res = summarize(3.0 * 245_569, 245_569, one_token_per_byte=False, protocol={}, word_count=245_569)
    assert res["word_perplexity"] == pytest.approx(math.exp(3.0)) == pytest.approx(res["token_perplexity"])
    # a byte model on the raw test file: 1,200,000 bytes at 0.9 nats each, normalised by 245,569 words
    res = summarize(0.9 * 1_200_000, 1_200_000, one_token_per_byte=True, protocol={}, word_count=245_569)
    assert res["word_perplexity"] == pytest.approx(math.exp(0.9 * 1_200_000 / 245_569))
    assert res["tokens_per_word"] == pytest.approx(1_200_000 / 245_569)
