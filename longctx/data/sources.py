"""Data sources, chosen by ``data.source`` through a registry.

A source is built from the ``data`` config section and offers::

    source.name                 # short name
    source.splits               # e.g. ('train', 'valid', 'test')
    source.default_tokenizer    # name in longctx.data.tokenizers
    source.metadata()           # dict describing the content, with a 'content_hash'
    source.documents(split)     # iterator of (doc_name, bytes | str)

``longctx.data.prepare`` turns a source into token files once.
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
}


def register(name: str, target: str) -> None:
    _SOURCES[name] = target


def names() -> tuple[str, ...]:
    return tuple(sorted(_SOURCES))


def build(data_cfg):
    name = data_cfg.source
    if name not in _SOURCES:
        raise ConfigError(f"data.source={name!r} is unknown; allowed: {', '.join(names())}")
    module_name, cls_name = _SOURCES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(data_cfg)
