"""Hugging Face ``datasets`` and ``tokenizers``, from local files only (the ``hf`` extra).

``data.source='hf'`` reads ``data.path`` (a file, a folder or a glob, listed and split exactly as
by ``data.source='files'``, :mod:`longctx.data.files`) through
``datasets.load_dataset(builder, data_files=[...], split='train', streaming=True)``, with
``builder`` = ``data.options.hf_builder`` (``'json'`` | ``'parquet'`` | ``'text'`` | ``'csv'``;
``''`` picks it from the file names). Each example's ``data.options.text_field`` is a document
(the ``text`` builder: one document per file, or per line / paragraph with
``data.options.separator`` = ``\\n`` / ``\\n\\n``). Streaming keeps memory bounded and writes no
Arrow cache.

``data.tokenizer='hf'`` encodes with a ``tokenizer.json`` (``data.options.tokenizer_file``) through
``tokenizers.Tokenizer.from_file``, with any source. Special tokens are not added per document;
the end-of-document token, appended after each document, is ``data.options.eos_token``, or when
that is ``''`` the first of :data:`EOS_CANDIDATES` in the vocabulary (none: no token is appended).
The vocabulary size (``get_vocab_size(with_added_tokens=True)``) becomes ``model.vocab_size``.

Nothing here touches the network: ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` are set
before ``datasets`` is imported, and a ``data.path`` or tokenizer file that is not a local path
(a Hub name such as ``'Salesforce/wikitext'``) is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from longctx.data.dsutil import option, sha256_file
from longctx.data.files import FilesSource, need
from longctx.data.spm import TextWithEos
from longctx.errors import ConfigError, DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BUILDERS = {"json": (".jsonl", ".json", ".ndjson"), "parquet": (".parquet",), "csv": (".csv",), "text": ()}
NO_HUB = ("longctx reads Hugging Face data from local files only and never downloads from the Hub: download "
          "the files yourself and point {what} at them")


def offline() -> None:
    """Keep ``datasets`` / ``huggingface_hub`` off the network, imported already or not."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ[var] = "1"
    import sys

    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True


def _local(path: str, what: str) -> None:
    if path and not any(ch in path for ch in "*?[") and not Path(path).expanduser().exists():
        raise DataError(f"{what}={path!r} is not a local file or folder; {NO_HUB.format(what=what)}")


class HFDatasetSource(FilesSource):
    name = "hf"

    def __init__(self, data_cfg=None, path: str | None = None):
        for key in ("path", "train_path", "valid_path", "test_path"):
            value = (path if path is not None else str(getattr(data_cfg, "path", "") or "")) if key == "path" \
                else str(option(data_cfg, key, ""))
            _local(value, "data.path" if key == "path" else f"data.options.{key}")
        self.builder = str(option(data_cfg, "hf_builder", ""))
        if self.builder and self.builder not in BUILDERS:
            raise ConfigError(f"data.options.hf_builder={self.builder!r}; allowed: {', '.join(BUILDERS)} (or '' to "
                              "pick it from the file names); Hub dataset names are not read")
        super().__init__(data_cfg, path)

    def reader_key(self) -> str:
        return f"hf|{self.builder}"

    def documents_rule(self) -> str:
        return f"examples of datasets.load_dataset (field {self.text_field!r})"

    def _builder_for(self, files: list[Path]) -> str:
        if self.builder:
            return self.builder
        kinds = set()
        for f in files:
            name = f.name.lower().removesuffix(".gz")
            kinds.add(next((b for b, suf in BUILDERS.items() if suf and name.endswith(suf)), "text"))
        if len(kinds) != 1:
            raise DataError(f"hf: the files mix formats ({', '.join(sorted(kinds))}); set data.options.hf_builder or "
                            "point data.path at files of one format")
        return kinds.pop()

    def raw_docs(self, root: Path, files: list[Path]):
        offline()
        datasets = need("datasets", "hf")
        builder = self._builder_for(files)
        kwargs = {}
        if builder == "text":
            sample_by = {"": "document", "\n": "line", "\n\n": "paragraph"}.get(self.separator)
            if sample_by is None:
                raise ConfigError(f"data.options.separator={self.separator!r}: the datasets 'text' builder splits "
                                  "documents by file (''), line ('\\n') or paragraph ('\\n\\n') only")
            kwargs["sample_by"] = sample_by
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                       **kwargs)
            for i, ex in enumerate(ds):
                if self.text_field not in ex:
                    fields = ", ".join(sorted(map(str, ex))[:8]) or "none"
                    raise DataError(f"hf: example {i} of {root} has no field {self.text_field!r} (its fields: "
                                    f"{fields}); set data.options.text_field to the field that holds the text")
                text = ex[self.text_field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(f"hf: field {self.text_field!r} of {root} holds {type(text).__name__} values, "
                                    "not text; set data.options.text_field to the field that holds the text")
                if text.strip():
                    yield f"{i}", text, True
        except UnicodeDecodeError as e:
            raise DataError(f"hf: a file of {root} is not UTF-8 text ({e.reason}); convert it to UTF-8") from None
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 -- datasets wraps reader errors in many types
            msg = " ".join(str(e).split())[:200]
            raise DataError(f"hf: datasets could not read {root} with the {builder!r} builder "
                            f"({type(e).__name__}: {msg})") from None


# -- tokenizer -------------------------------------------------------------------------------
def tokenizer_kwargs(data_cfg) -> dict:
    path = str(option(data_cfg, "tokenizer_file", ""))
    if not path:
        raise ConfigError("data.tokenizer='hf' encodes with a Hugging Face tokenizer.json: set "
                          "data.options.tokenizer_file to its path")
    p = Path(path).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if not p.is_file():
        _local(path, "data.options.tokenizer_file")
        raise DataError(f"data.options.tokenizer_file={path!r} is not a file; expected a tokenizer.json")
    return {"tokenizer_file": str(p.resolve()), "file_sha256": sha256_file(p),
            "eos_token": str(option(data_cfg, "eos_token", ""))}


class HFTokenizer:
    name = "hf"
    one_token_per_byte = False
    cache_kwargs = staticmethod(tokenizer_kwargs)  # what longctx.data.prepare keys the token cache by

    def __init__(self, tokenizer_file: str = "", eos_token: str = "", **_ignored):
        if not tokenizer_file:
            raise ConfigError("data.tokenizer='hf' encodes with a Hugging Face tokenizer.json: set "
                              "data.options.tokenizer_file to its path")
        path = Path(tokenizer_file)
        tokenizers = need("tokenizers", "hf")
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- the Rust side raises a plain Exception
            msg = " ".join(str(e).split())[:160]
            raise DataError(f"{path} is not a Hugging Face tokenizer file ({msg}); expected a tokenizer.json as "
                            "saved by tokenizers (Tokenizer.save) or transformers (save_pretrained)") from None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(int(self.tok.get_vocab_size(with_added_tokens=True)), max(vocab.values(), default=-1) + 1)
        if eos_token:
            if eos_token not in vocab:
                raise DataError(f"data.options.eos_token={eos_token!r} is not in the vocabulary of {path}")
            self.eos_id = int(vocab[eos_token])
        else:
            self.eos_id = next((int(vocab[t]) for t in EOS_CANDIDATES if t in vocab), None)
        self.eos_token = eos_token or next((t for t in EOS_CANDIDATES if t in vocab), "")
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, data: bytes | str) -> np.ndarray:
        # a Hugging Face tokenizer reads text: bytes that are not UTF-8 (a Latin-1 source file in the built-in
        # corpus) become U+FFFD, as Python's own replacement decoding makes them
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else str(data)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if isinstance(data, TextWithEos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")
