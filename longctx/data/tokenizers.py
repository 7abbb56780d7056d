"""Tokenizers, chosen by ``data.tokenizer`` through a registry.

A tokenizer has ``vocab_size``, ``encode(text_or_bytes) -> np.ndarray`` and
``decode(ids) -> str``, plus ``dtype`` (the numpy dtype of token files), and
``bytes_per_token_exact`` (True when one token is one byte, so bits per token are
bits per byte).
"""

from __future__ import annotations

import numpy as np

from longctx.errors import ConfigError


class ByteTokenizer:
    """Token id = byte value; vocabulary 256."""

    name = "bytes"
    vocab_size = 256
    dtype = np.uint8
    one_token_per_byte = True

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist())


# name -> "module:Class" (or a factory). One line per tokenizer.
_TOKENIZERS: dict = {
    "bytes": "longctx.data.tokenizers:ByteTokenizer",
    "words": "longctx.data.wordvocab:WordTokenizer",
    "sentencepiece": "longctx.data.spm:SentencePieceTokenizer",
    "hf": "longctx.data.hf:HFTokenizer",  # a Hugging Face tokenizer.json (data.options.tokenizer_file)
    "bpe": "longctx.data.bpe:BPETokenizer",  # lossless byte-level BPE trained on the train split
}


def register(name: str, factory) -> None:
    _TOKENIZERS[name] = factory


def names() -> tuple[str, ...]:
    return tuple(sorted(_TOKENIZERS))


def factory(name: str):
    """The tokenizer class (or factory) registered as ``name``, imported on first use."""
    if name not in _TOKENIZERS:
        raise ConfigError(f"data.tokenizer={name!r} is unknown; allowed: {', '.join(names())}")
    made = _TOKENIZERS[name]
    if isinstance(made, str):
        import importlib

        module_name, cls_name = made.split(":")
        made = getattr(importlib.import_module(module_name), cls_name)
    return made


def cache_kwargs(name: str, data_cfg) -> dict:
    """What a tokenizer of ``name`` is built from beyond its name (e.g. a tokenizer file by its sha256): its
    ``cache_kwargs(data_cfg)`` where it declares one, else nothing."""
    declared = getattr(factory(name), "cache_kwargs", None)
    return declared(data_cfg) if declared is not None else {}


def is_trained(name: str, data_cfg, meta) -> bool:
    """Whether a tokenizer of ``name`` that is trained on the data (``is_trained(data_cfg, meta)`` where it declares
    one) has its model already, so that :func:`cache_kwargs` trains nothing; True for the others."""
    declared = getattr(factory(name), "is_trained", None)
    return declared is None or declared(data_cfg, meta)


def build(name: str, **kwargs):
    return factory(name)(**kwargs)
