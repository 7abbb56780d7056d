"""Token files: a source's split tokenized once into the cache directory.

Layout of ``<cache_dir>/<source>-<tokenizer>-<hash12>/``::
    <split>.bin         tokens, raw little-endian array of the tokenizer's dtype
    <split>.docs.npy    int64 document start offsets, plus the total at the end
    <split>.json        manifest: counts, dtype, sha256 of the .bin, source metadata

Files are written under temporary names and renamed into place, the manifest
last, so an interrupted preparation never leaves files that look complete.
Preparing again is a no-op when the manifest and sizes match.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from longctx.data import sources, tokenizers
from longctx.errors import ConfigError, DataError, LongctxError


class Continued(str):
    """A piece of a document that goes on in the next payload: a source yields a long document as
    ``Continued`` pieces and a last ordinary payload, and no document boundary is recorded after a
    piece (so a document never has to be held whole in memory)."""

    __slots__ = ()


def default_cache_dir() -> Path:
    return Path(os.environ.get("LONGCTX_CACHE") or Path.home() / ".cache" / "longctx")


@dataclasses.dataclass
class TokenData:
    """One prepared split: memory-mapped tokens and document boundaries."""

    tokens: np.ndarray  # [N] memmap
    doc_starts: np.ndarray  # [n_docs + 1] int64, last = N
    manifest: dict

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts.shape[0] - 1)

    def doc_ids(self) -> np.ndarray:
        ids = np.zeros(self.num_tokens, np.int32)
        ids[self.doc_starts[1:-1]] = 1
        return np.cumsum(ids, dtype=np.int32)


def cache_path(source_meta: dict, tokenizer_name: str, cache_dir: str | os.PathLike | None, extra: str = "") -> Path:
    key = hashlib.sha256((source_meta["content_hash"] + tokenizer_name + extra).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"{source_meta['source']}-{tokenizer_name}-{key}"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def atomic_write_with(path: Path, writer) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[str]:
    removed = []
    if not directory.is_dir():
        return removed
    for p in directory.glob(".*.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if not _pid_alive(pid):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def is_prepared(directory: Path, split: str) -> bool:
    man = directory / f"{split}.json"
    if not man.exists():
        return False
    try:
        manifest = json.loads(man.read_text())
        size = (directory / f"{split}.bin").stat().st_size
        docs = np.load(directory / f"{split}.docs.npy")
    except (OSError, ValueError, json.JSONDecodeError):
        return False
    itemsize = np.dtype(manifest["dtype"]).itemsize
    return size == manifest["num_tokens"] * itemsize and docs.shape[0] == manifest["num_docs"] + 1


def prepare_split(source, tokenizer, split: str, directory: Path, *, source_meta: dict, progress: bool = True) -> Path:
    """Tokenize one split of ``source`` into ``directory`` (no-op if already prepared)."""
    directory.mkdir(parents=True, exist_ok=True)
    if is_prepared(directory, split):
        return directory
    bin_path = directory / f"{split}.bin"
    starts = array.array("q", [0])  # 8 bytes a document
    h = hashlib.sha256()
    total_docs = source.count(split) if hasattr(source, "count") else None

    def write_tokens(f):
        total = 0
        docs = source.documents(split)
        with tqdm(desc=f"prepare {split}", unit="doc", total=total_docs, disable=not progress, leave=False) as bar:
            for _name, payload in docs:
                ids = np.ascontiguousarray(tokenizer.encode(payload), dtype=tokenizer.dtype)
                b = ids.tobytes()
                f.write(b)
                h.update(b)
                total += ids.shape[0]
                bar.set_postfix_str(f"{total:,} tokens", refresh=False)  # moves within a long document too
                if not isinstance(payload, Continued):  # a piece: the document goes on
                    starts.append(total)
                    bar.update(1)
                else:
                    bar.update(0)  # redraws at tqdm's own interval

    atomic_write_with(bin_path, write_tokens)
    docs = np.frombuffer(starts, dtype=np.int64).copy()
    atomic_write_with(directory / f"{split}.docs.npy", lambda f: np.save(f, docs))
    manifest = {
        "split": split,
        "num_tokens": int(docs[-1]),
        "num_docs": int(docs.shape[0] - 1),
        "dtype": np.dtype(tokenizer.dtype).name,
        "vocab_size": int(tokenizer.vocab_size),
        "tokenizer": tokenizer.name,
        "eos_id": getattr(tokenizer, "eos_id", None),
        "sha256": h.hexdigest(),
        "source": source_meta,
    }
    atomic_write_with(directory / f"{split}.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return directory


def load_split(directory: Path, split: str, *, verify: bool = False) -> TokenData:
    if not is_prepared(directory, split):
        raise DataError(f"no prepared token file for split {split!r} in {directory}; run longctx-prepare first")
    manifest = json.loads((directory / f"{split}.json").read_text())
    if verify and sha256_file(directory / f"{split}.bin") != manifest["sha256"]:
        raise DataError(f"{directory / (split + '.bin')}: checksum mismatch; delete {directory} and prepare again")
    tokens = np.memmap(directory / f"{split}.bin", dtype=manifest["dtype"], mode="r", shape=(manifest["num_tokens"],))
    return TokenData(tokens=tokens, doc_starts=np.load(directory / f"{split}.docs.npy"), manifest=manifest)


def tokenizer_kwargs(source, data_cfg, meta) -> dict:
    """What the tokenizer is built from; part of the cache key (a tokenizer file by its sha256)."""

    kw = source.tokenizer_kwargs(data_cfg, meta) if hasattr(source, "tokenizer_kwargs") else {}
    return {**kw, **tokenizers.cache_kwargs(data_cfg.tokenizer, data_cfg)}


def prepared_manifest(data_cfg, split: str = "train") -> dict | None:
    """The manifest of ``split`` (its ``num_docs``, ``num_tokens``, ``vocab_size``, ...) where it is already
    prepared in the cache :func:`prepare` would use, else None (not prepared yet, a generated source, or data that
    cannot be found): nothing is prepared, written or trained (``longctx-train --dry_run`` plans from it)."""
    if sources.is_generated(data_cfg.source):
        return None
    try:
        source = sources.build(data_cfg)
        meta = source.metadata()
        if not tokenizers.is_trained(data_cfg.tokenizer, data_cfg, meta):  # its cache key names the trained
            return None  # model: none yet, nothing prepared
        extra = json.dumps(tokenizer_kwargs(source, data_cfg, meta), sort_keys=True, default=str)
        directory = cache_path(meta, data_cfg.tokenizer, data_cfg.cache_dir, extra=extra)
        if not is_prepared(directory, split):
            return None
        return json.loads((directory / f"{split}.json").read_text())
    except (LongctxError, OSError, ValueError):
        return None


def prepare(data_cfg, splits=None, *, progress: bool = True, trust_cache_dir: bool = True):
    """Build the source and tokenizer of ``data_cfg``; prepare and load the splits.

    ``trust_cache_dir=False``: ``data_cfg.cache_dir`` came from a checkpoint, not from the user; it
    is used only where it already holds this dataset's folder (made by the training), else the
    default cache is, so a checkpoint cannot point writes anywhere else. Returns (tokenizer,
    {split: TokenData}, directory).
    """

    if sources.is_generated(data_cfg.source):
        raise ConfigError(f"data.source={data_cfg.source!r} is a generated recall task: its rows are made on the fly "
                          "and there is nothing to prepare (train on it directly; score it with longctx-recall)")
    source = sources.build(data_cfg)
    meta = source.metadata()
    tok_kwargs = tokenizer_kwargs(source, data_cfg, meta)
    extra = json.dumps(tok_kwargs, sort_keys=True, default=str)
    directory = cache_path(meta, data_cfg.tokenizer, data_cfg.cache_dir, extra=extra)
    root = directory.parent
    if root.exists() and not root.is_dir():
        raise DataError(f"data.cache_dir {root} is a file, not a folder; set data.cache_dir to a folder "
                        "(or '' for the default cache)")
    if not trust_cache_dir and data_cfg.cache_dir:
        if not directory.is_dir():
            directory = cache_path(meta, data_cfg.tokenizer, None, extra=extra)
    if getattr(tokenizers.factory(data_cfg.tokenizer), "cache_kwargs", None) is not None:
        # a tokenizer built from what its cache_kwargs name (hf: a tokenizer.json; bpe: the BPE trained on this
        # source's train split), the same way for every source
        tokenizer = tokenizers.build(data_cfg.tokenizer, **tok_kwargs)
    elif hasattr(source, "build_tokenizer"):
        tokenizer = source.build_tokenizer(data_cfg, directory)
    else:
        tokenizer = tokenizers.build(data_cfg.tokenizer, **tok_kwargs)
    remove_stale_temporaries(directory)
    out = {}
    for split in splits or source.splits:
        try:
            prepare_split(source, tokenizer, split, directory, source_meta=meta, progress=progress)
            out[split] = load_split(directory, split)
        except LongctxError:
            raise
        except OSError as e:  # disk full, a read-only or unwritable cache, ...
            why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise DataError(f"cannot prepare the {split} split in {directory} ({why}); free space or set "
                            "data.cache_dir to a writable folder, then run again") from None
    return tokenizer, out, directory
