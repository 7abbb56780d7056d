"""Data sources, chosen by ``data.source`` through a registry.

A source is built from the ``data`` config section and offers::

    source.name                 # short name
    source.splits               # e.g. ('train', 'valid', 'test')
    source.default_tokenizer    # name in longctx.data.tokenizers
    source.metadata()           # dict describing the content, with a 'content_hash'
    source.documents(split)     # iterator of (doc_name, bytes | str)
    source.single_document      # optional: True where every split is one document (enwik8)

``longctx.data.prepare`` turns a source into token files once. A *generated* source
(``source.generated``, :mod:`longctx.data.synthetic`) has no token files: it makes each batch
row as a pure function of (seed, step, row) and says which targets are scored.
"""

from __future__ import annotations

import importlib

from longctx.errors import ConfigError

# name -> "module:Class". One line per source.
_SOURCES: dict[str, str] = {
    "builtin": "longctx.data.builtin:BuiltinSource",
    "enwik8": "longctx.data.enwik8:Enwik8Source",
    "wikitext103": "longctx.data.wikitext103:WikiText103Source",
    "pg19": "longctx.data.pg19:PG19Source",
    # your own corpus (longctx/data/files.py, longctx/data/hf.py)
    "files": "longctx.data.files:FilesSource",
    "hf": "longctx.data.hf:HFDatasetSource",
    # generated on the fly (longctx/data/synthetic.py): rows, not token files
    "mqar": "longctx.data.synthetic:MQARSource",
    "passkey": "longctx.data.synthetic:PasskeySource",
    "copy": "longctx.data.synthetic:CopySource",
}


def register(name: str, target: str) -> None:
    _SOURCES[name] = target


def names() -> tuple[str, ...]:
    return tuple(sorted(_SOURCES))


def is_generated(name: str) -> bool:
    """Whether ``data.source=name`` generates rows on the fly (no token files to prepare)."""
    return _SOURCES.get(name, "").startswith("longctx.data.synthetic:")


def single_document(name: str) -> bool:
    """Whether every split of ``data.source=name`` is one document (the source class's ``single_document``)."""
    if name not in _SOURCES:
        return False
    module_name, cls_name = _SOURCES[name].split(":")
    return bool(getattr(getattr(importlib.import_module(module_name), cls_name), "single_document", False))


def build(data_cfg):
    name = data_cfg.source
    if name not in _SOURCES:
        raise ConfigError(f"data.source={name!r} is unknown; allowed: {', '.join(names())}")
    module_name, cls_name = _SOURCES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(data_cfg)
