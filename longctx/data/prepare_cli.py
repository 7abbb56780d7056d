"""``longctx-prepare``: tokenize every split of a config's data source once.

    longctx-prepare --config configs/enwik8/dense.py:tiny --config.data.path=/data/enwik8.zip

Same flags as ``longctx-train`` (``--workdir`` is not needed; ``--noprogress`` hides the
bars). Prepares train, valid and test into ``<cache_dir>/<source>-<tokenizer>-<hash>/`` and
prints a summary: tokens, documents, sha256 and words per split, and the directory.
Running it again is a no-op. Temporary files left in that directory by a killed run
(``.<name>.tmp-<pid>`` whose process is gone) are removed first.
"""

from __future__ import annotations

from pathlib import Path

from longctx import config as config_lib
from longctx.data import sources
from longctx.data.prepare import cache_path, prepare, remove_stale_temporaries, tokenizer_kwargs
from longctx.errors import ConfigError


def target_directory(data_cfg) -> Path:
    """The directory ``prepare`` will use (computed the same way)."""
    import json

    source = sources.build(data_cfg)
    meta = source.metadata()
    kw = tokenizer_kwargs(source, data_cfg, meta)
    return cache_path(meta, data_cfg.tokenizer, data_cfg.cache_dir, extra=json.dumps(kw, sort_keys=True, default=str))


def summary(tokenizer, data: dict, directory: Path) -> str:
    any_split = next(iter(data.values()))
    meta = any_split.manifest.get("source", {})
    lines = [f"source {meta.get('source', '?')}, tokenizer {tokenizer.name} (vocabulary {tokenizer.vocab_size:,}, "
             f"{any_split.manifest['dtype']})"]
    words = meta.get("word_counts") or {}
    for split, d in data.items():
        m = d.manifest
        extra = f"  words {words[split]:,}" if split in words else ""
        lines.append(f"  {split:<5} {m['num_tokens']:>14,} tokens {m['num_docs']:>9,} docs  sha256 {m['sha256']}{extra}")
    lines.append(f"directory {directory}")
    return "\n".join(lines)


def prepare_all(cfg, *, progress: bool = True) -> None:
    """Validate ``cfg``, remove temporaries of killed runs, prepare every split, print the summary."""

    cfg = config_lib.validate(cfg)
    if sources.is_generated(cfg.data.source):
        raise ConfigError(f"data.source={cfg.data.source!r} is a generated recall task: its rows are made on the fly "
                          "and there is nothing to prepare (train on it directly; score it with longctx-recall)")
    removed = remove_stale_temporaries(target_directory(cfg.data))
    if removed:
        print(f"removed {len(removed)} temporary file(s) left by an interrupted run")
    tokenizer, data, directory = prepare(cfg.data, progress=progress)
    print(summary(tokenizer, data, directory))

