"""enwik8 source: layout, checks, 90/5/5 split, txl_compat, bpc arithmetic."""

import math
import zipfile

import ml_collections
import numpy as np
import pytest

from longctx.config import base_config
from longctx.data import enwik8, sources
from longctx.data.prepare import prepare
from longctx.errors import DataError
from longctx.protocols import summarize


def fixture_bytes(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    body = rng.integers(32, 127, size=n, dtype=np.uint8)
    body[rng.integers(0, n, size=n // 40)] = 10  # newlines
    return enwik8.HEADER + body.tobytes()[len(enwik8.HEADER):]


def write_zip(path, data, member="enwik8"):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
    return path


def data_cfg(path, cache, **options):
    c = base_config().data
    c.source = "enwik8"
    c.path = str(path)
    c.cache_dir = str(cache)
    c.options.verify = False
    for k, v in options.items():
        c.options[k] = v
    return ml_collections.ConfigDict(c.to_dict())


def test_split_bounds_are_the_standard_90_5_5_on_the_real_size():
    b = enwik8.split_bounds(100_000_000)
    assert b == {"train": (0, 90_000_000), "valid": (90_000_000, 95_000_000), "test": (95_000_000, 100_000_000)}
    b = enwik8.split_bounds(4001)  # k = 200: last 400 bytes are valid + test
    assert b == {"train": (0, 3601), "valid": (3601, 3801), "test": (3801, 4001)}


def test_registered_and_zip_in_folder_is_found(tmp_path):
    assert "enwik8" in sources.names()
    write_zip(tmp_path / "enwik8.zip", fixture_bytes())
    (tmp_path / "enwik8").write_bytes(b"other")  # the zip wins over the unzipped copy
    src = sources.build(data_cfg(tmp_path, tmp_path / "cache"))
    assert src.file == tmp_path / "enwik8.zip" and src.kind == "zip"


def test_prepare_zip_fixture_counts_and_boundaries(tmp_path):
    data = fixture_bytes(4000)
    write_zip(tmp_path / "enwik8.zip", data)
    tok, out, directory = prepare(data_cfg(tmp_path / "enwik8.zip", tmp_path / "cache"), progress=False)
    assert tok.vocab_size == 256 and tok.one_token_per_byte
    assert [out[s].num_tokens for s in ("train", "valid", "test")] == [3600, 200, 200]
    assert bytes(np.asarray(out["train"].tokens)) == data[:3600]
    assert bytes(np.asarray(out["valid"].tokens)) == data[3600:3800]
    assert bytes(np.asarray(out["test"].tokens)) == data[3800:]
    assert all(out[s].num_docs == 1 for s in out)
    meta = out["test"].manifest["source"]
    assert meta["verified"] is False and meta["standard"] is False and meta["kind"] == "zip"
    assert meta["scored_bytes"]["test"] == 200


def test_unzipped_file_gives_the_same_tokens(tmp_path):
    data = fixture_bytes(2000, seed=1)
    write_zip(tmp_path / "enwik8.zip", data)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "enwik8").write_bytes(data)
    _, a, _ = prepare(data_cfg(tmp_path / "enwik8.zip", tmp_path / "c1"), ["valid"], progress=False)
    _, b, _ = prepare(data_cfg(tmp_path / "raw", tmp_path / "c2"), ["valid"], progress=False)
    np.testing.assert_array_equal(np.asarray(a["valid"].tokens), np.asarray(b["valid"].tokens))


def test_txl_compat_drops_newlines_after_splitting(tmp_path):
    data = fixture_bytes(4000, seed=2)
    write_zip(tmp_path / "enwik8.zip", data)
    _, out, d1 = prepare(data_cfg(tmp_path, tmp_path / "cache", txl_compat=True), progress=False)
    _, plain, d2 = prepare(data_cfg(tmp_path, tmp_path / "cache"), ["test"], progress=False)
    assert d1 != d2  # separate token files
    test_bytes = data[3800:]
    assert bytes(np.asarray(out["test"].tokens)) == test_bytes.replace(b"\n", b"")
    assert out["test"].num_tokens == 200 - test_bytes.count(b"\n") < plain["test"].num_tokens == 200
    assert 10 not in np.asarray(out["train"].tokens)
    assert out["test"].manifest["source"]["scored_bytes"]["test"] == out["test"].num_tokens


def test_default_verifies_sizes_and_names_the_source(tmp_path):
    write_zip(tmp_path / "enwik8.zip", fixture_bytes())
    cfg = data_cfg(tmp_path, tmp_path / "cache")
    cfg.options.verify = True
    assert base_config().data.options.verify is True  # the default checks
    with pytest.raises(DataError) as e:
        prepare(cfg, progress=False)
    msg = str(e.value)
    assert "36,445,475" in msg and enwik8.ZIP_SHA256 in msg and "mattmahoney.net/dc/enwik8.zip" in msg


def test_wrong_size_unzipped_file_is_rejected(tmp_path):
    (tmp_path / "enwik8").write_bytes(fixture_bytes(1000))
    with pytest.raises(DataError, match="100,000,000"):
        enwik8.Enwik8Source(path=str(tmp_path), verify=True).metadata()


def test_right_size_wrong_content_is_rejected(tmp_path):
    f = tmp_path / "enwik8"
    with open(f, "wb") as fh:  # sparse 10^8-byte file of zeros
        fh.truncate(enwik8.NUM_BYTES)
    with pytest.raises(DataError, match="205 distinct|not enwik8"):
        enwik8.Enwik8Source(path=str(f), verify=True).metadata()


def test_wrong_checksum_zip_of_the_right_size_is_rejected(tmp_path):
    f = tmp_path / "enwik8.zip"
    with open(f, "wb") as fh:
        fh.truncate(enwik8.ZIP_BYTES)
    with pytest.raises(DataError, match="sha256"):
        enwik8.Enwik8Source(path=str(f), verify=True).metadata()


def test_missing_file_says_what_and_where(tmp_path):
    with pytest.raises(DataError) as e:
        enwik8.Enwik8Source(path=str(tmp_path))
    assert "enwik8.zip" in str(e.value) and enwik8.URL in str(e.value)
    with pytest.raises(DataError, match="data.path"):
        enwik8.Enwik8Source(path="")


def test_corrupt_zip_is_detected_not_half_read(tmp_path):
    data = fixture_bytes(20000, seed=3)
    f = write_zip(tmp_path / "enwik8.zip", data)
    raw = bytearray(f.read_bytes())
    mid = len(raw) // 2
    raw[mid] ^= 0xFF  # inside the deflate stream
    f.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="corrupt"):
        enwik8.Enwik8Source(path=str(f), verify=False).metadata()
    # truncated
    f.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match="corrupt|truncated"):
        enwik8.Enwik8Source(path=str(f), verify=False).metadata()


def test_zip_with_other_members_is_rejected(tmp_path):
    f = write_zip(tmp_path / "enwik8.zip", b"abc", member="enwik9")
    with pytest.raises(DataError, match="exactly one member"):
        enwik8.Enwik8Source(path=str(f), verify=False).metadata()


def test_bpc_arithmetic():
    # 5 bytes each with p = 1/4: 2 bits per byte exactly
    res = summarize(5 * math.log(4.0), 5, one_token_per_byte=True, protocol={"mode": "stream-with-state"})
    assert res["bits_per_byte"] == pytest.approx(2.0) and res["tokens_scored"] == 5
    res = summarize(1.2 * 1000, 1000, one_token_per_byte=True, protocol={})
    assert res["bits_per_byte"] == pytest.approx(1.2 / math.log(2))
