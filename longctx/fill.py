"""``longctx-fill``: fill masked bytes of a text with a trained encoder (masked LM), to look at what
it learned.

    longctx-fill --workdir runs/mlm_dense --text='def f(x):\\n    return ____'
    longctx-fill --workdir runs/mlm_dense --text='import os, sys' --mask_spans=7:9,11:14

Every ``--mask_char`` byte (default ``_``) of the text is masked, or, with ``--mask_spans``, the
byte ranges ``start:end`` (end excluded) whatever they hold. ``\\n``, ``\\t`` and ``\\\\`` in
``--text`` are escapes (``--noescapes`` turns that off). The text is padded with newlines to the
run's row length (``train.seq_len``; a longer text is refused), the masked bytes are given the
mask token and marked as the important tokens, and the encoder fills them greedily, the
``--per_pass`` most confident ones per forward pass (default 1: each fill sees the earlier ones).
Byte-level runs only.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longctx import config as config_lib
from longctx.data import masking
from longctx.errors import ConfigError
from longctx.runtime import Runner

PAD_BYTE = ord("\n")


def unescape(text: str) -> str:
    return re.sub(r"\\(n|t|\\)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def parse_spans(spec: str, n: int) -> list[tuple[int, int]]:
    spans = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if not m:
            raise ConfigError(f"--mask_spans={spec!r}: each span is start:end in bytes (end excluded), e.g. 4:8,12:15")
        a, b = int(m.group(1)), int(m.group(2))
        if not 0 <= a < b <= n:
            raise ConfigError(f"--mask_spans: span {a}:{b} must satisfy 0 <= start < end <= {n} (the text's bytes)")
        spans.append((a, b))
    return spans


def masked_bytes(text: str, *, mask_char: str = "_", mask_spans: str | None = None) -> tuple[bytes, np.ndarray]:
    """(the text's UTF-8 bytes, [n] bool mask of the bytes to fill)."""
    data = text.encode("utf-8")
    mask = np.zeros(len(data), bool)
    if mask_spans:
        for a, b in parse_spans(mask_spans, len(data)):
            mask[a:b] = True
    else:
        if len(mask_char.encode("utf-8")) != 1:
            raise ConfigError(f"--mask_char={mask_char!r} must be one single-byte character")
        mask = np.frombuffer(data, np.uint8) == ord(mask_char)
    if not mask.any():
        how = "--mask_spans is empty" if mask_spans else f"the text has no {mask_char!r}"
        raise ConfigError(f"nothing to fill: {how}; mark the bytes to fill with --mask_char or --mask_spans")
    return data, mask


def fill_bytes(runner, data: bytes, mask: np.ndarray, *, per_pass: int = 1) -> tuple[bytes, int]:
    """Fill the masked bytes of ``data`` with ``runner``'s encoder; returns (filled bytes, passes)."""
    tok = runner.tokenizer
    # the mask id as training resolved it (one beyond the vocabulary, or an import's own <mask> / [MASK]); the
    # fills are the tokenizer's text ids, never the mask id nor another special token (masking.text_ids)
    cfg = config_lib.resolve_vocab(runner.cfg, tok.vocab_size, mask_token=masking.own_mask_id(tok))
    T, mask_id = cfg.train.seq_len, cfg.mlm.mask_id
    allowed = jnp.asarray(masking.text_ids(tok, mask_id, cfg.model.vocab_size))
    if len(data) > T:
        raise ConfigError(f"the text is {len(data)} bytes; this encoder reads rows of {T} bytes (train.seq_len)")
    ids = np.full(T, PAD_BYTE, np.int32)
    ids[: len(data)] = np.frombuffer(data, np.uint8)
    important = np.zeros(T, bool)
    important[: len(data)] = mask
    ids[important] = mask_id
    graphdef = runner.graphdef

    @jax.jit
    def predict(params, ids, important):
        logits, _ = nnx.merge(graphdef, *params)(ids[None], important[None], deterministic=True)
        logp = jax.nn.log_softmax(jnp.where(allowed, logits[0], -jnp.inf), axis=-1)
        return jnp.argmax(logp, -1), jnp.max(logp, -1)

    todo = important.copy()
    passes = 0
    while todo.any():
        best, conf = (np.asarray(a) for a in predict(runner.params, jnp.asarray(ids), jnp.asarray(important)))
        order = np.flatnonzero(todo)[np.argsort(-conf[todo], kind="stable")][: max(1, per_pass)]
        ids[order] = best[order]
        todo[order] = False
        passes += 1
    return ids[: len(data)].astype(np.uint8).tobytes(), passes


def fill_run(workdir, text: str, *, step=None, mask_char="_", mask_spans=None, per_pass=1, escapes=True) -> str:
    if per_pass < 1:
        raise ConfigError(f"--per_pass={per_pass} must be a positive integer")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes of the command line that are not UTF-8 arrive as surrogates
        raise ConfigError(f"the text to fill is not UTF-8 (byte {e.start}); give UTF-8 text with --text or "
                          "--text_file") from None
    runner = Runner.from_workdir(workdir, step=step)
    if not runner.is_encoder:
        raise ConfigError(f"{workdir} holds a decoder (model.kind='decoder'); longctx-fill needs an encoder run, "
                          "longctx-sample continues a decoder's text")
    if not runner.tokenizer_is_bytes:
        raise ConfigError(f"longctx-fill works on byte-level runs; {workdir} uses data.tokenizer="
                          f"{runner.cfg.data.tokenizer!r}")
    data, mask = masked_bytes(unescape(text) if escapes else text, mask_char=mask_char, mask_spans=mask_spans)
    filled, passes = fill_bytes(runner, data, mask, per_pass=per_pass)
    out = filled.decode("utf-8", errors="replace")
    print(out)
    print(f"(filled {int(mask.sum())} masked bytes in {passes} passes, step {runner.step} of {workdir}; "
          f"{filled_spans(filled, mask)})", file=sys.stderr)
    return out


def filled_spans(filled: bytes, mask: np.ndarray) -> str:
    """Which bytes were filled, each run of them as ``start:end 'bytes'`` (escaped, so a filled space or
    newline shows): ``filled 21:25 'x + '``."""
    idx = np.flatnonzero(mask)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1) if len(idx) else []
    return "filled " + ", ".join(f"{r[0]}:{r[-1] + 1} {repr(filled[r[0]:r[-1] + 1])[1:]}" for r in runs)
