"""``longctx-sample``: prefill a prompt, then decode token by token with the
model's own state (never re-running the prefix), streaming the text.

    longctx-sample --workdir runs/vq --prompt "def " --num_tokens 8192 --temperature 0.8

Each run writes a new ``WORKDIR/samples/step<N>_seed<S>[-<k>].txt`` (and ``.json``); an existing
sample is never overwritten.

Documents (a tokenizer with an end-of-document token, :func:`document_end_id`: ``sentencepiece`` and ``hf``; a
prompt holds several where that token is written in it, e.g. ``<|endoftext|>`` for a GPT-2 ``tokenizer.json``): a
boundary is a fresh start. Each document of the prompt is fed with its own segment id and positions from 0, and a
token sampled after an end-of-document token opens a new document (the next id, position 0), as packed training
rows do (``data.packing='segments'``). The first token of a new document is sampled from the end-of-document
token's logits (there is no start-of-document token); what follows it equals a fresh start from that token, the
sampling key included (each document's tokens count their keys from its start). Until the first boundary the calls
are the plain ones (no segment ids), so a sample that never crosses one is unchanged. Where a layer's attention
method takes no segment ids (``AttentionCore.takes_segments``), documents run on in one context as before."""

from __future__ import annotations

import codecs
import errno
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from longctx import attention
from longctx.config import attention_label
from longctx.errors import ConfigError, LongctxError
from longctx.models.blocks import layer_methods
from longctx.runtime import Runner


def filter_logits(logits, *, temperature: float, top_k: int, top_p: float):
    """Temperature, top-k and nucleus filtering of [B, V] logits (fp32)."""
    logits = logits.astype(jnp.float32) / max(temperature, 1e-6)
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each entry
        cutoff = jnp.min(jnp.where(cum < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def make_decoder(runner, *, temperature: float, top_k: int, top_p: float):
    """(prefill, step), jitted; ``positions`` / ``segment_ids`` [1, T] int32 of packed calls, or None (plain). Both
    take the state donated: :func:`generate` hands each call the state the previous one returned and never reads it
    again, so a decoding step does not copy a state sized for the whole sample (a KV cache of prompt + new tokens)."""
    graphdef = runner.graphdef

    @functools.partial(jax.jit, donate_argnums=2)
    def prefill(params, tokens, state, positions=None, segment_ids=None):
        model = nnx.merge(graphdef, *params)
        logits, state, _ = model(tokens, state, deterministic=True, positions=positions, segment_ids=segment_ids)
        return logits[:, -1], state

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, logits, state, key, positions=None, segment_ids=None):
        if temperature == 0:
            tok = jnp.argmax(logits, axis=-1)
        else:
            tok = jax.random.categorical(key, filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p))
        model = nnx.merge(graphdef, *params)
        new_logits, state, _ = model(tok[:, None].astype(jnp.int32), state, deterministic=True, positions=positions,
                                     segment_ids=segment_ids)
        return tok, new_logits[:, -1], state

    return prefill, step


def document_end_id(tok) -> int | None:
    """The token that ends a document in ``tok``'s streams (its end-of-document token), or None: a tokenizer with
    none (``bytes``), or one whose plain text encodes to it (the ``words`` tokenizer's ``<eos>`` ends every line,
    not only documents, so it marks no boundary)."""
    eos = getattr(tok, "eos_id", None)
    if eos is None or int(eos) < 0:
        return None
    return None if int(eos) in np.asarray(tok.encode("\n")).tolist() else int(eos)


def keeps_documents_apart(model_cfg) -> bool:
    """Whether every layer's attention method takes segment ids (``AttentionCore.takes_segments``), so a document
    boundary can be a fresh start."""
    return all(attention.get_class(m).takes_segments for m in layer_methods(model_cfg))


def documents(ids, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, positions) [T] int32 of a token stream whose documents end with ``eos_id``: 1, 2, 3, ... per
    document (a document opens at the first token and after every end-of-document token, which closes its own),
    positions from 0 at each document's first token."""
    ids = np.asarray(ids)
    at = np.arange(len(ids))
    new = np.ones(len(ids), bool)
    new[1:] = ids[:-1] == eos_id
    start = np.maximum.accumulate(np.where(new, at, 0))
    return np.cumsum(new).astype(np.int32), (at - start).astype(np.int32)


def generate(runner, prompt_ids: np.ndarray, num_tokens: int, *, temperature=0.8, top_k=0, top_p=1.0, seed=0,
             on_token=None, eos_id: int | None = None):
    """Returns (token ids, per-token seconds). Decoding state capacity = prompt + num_tokens. ``eos_id``: the
    end-of-document token (:func:`document_end_id`); with it, and a model whose methods all take segment ids, each
    document (of the prompt or sampled) starts afresh (module docstring). None: one context, as before."""
    prefill, step = make_decoder(runner, temperature=temperature, top_k=top_k, top_p=top_p)
    prompt_ids = np.asarray(prompt_ids)
    n_prompt = len(prompt_ids)
    try:
        state = runner.init_state(1, n_prompt + num_tokens)
    except ValueError as e:  # a state with a fixed capacity (e.g. fma's levels) refuses the length

        raise ConfigError(f"cannot sample {n_prompt} prompt + {num_tokens} new tokens: {' '.join(str(e).split())}; "
                          "shorten the prompt or lower --num_tokens") from None
    apart = eos_id is not None and keeps_documents_apart(runner.cfg.model)
    seg, pos = documents(prompt_ids, eos_id) if apart else (np.ones(n_prompt, np.int32), np.arange(n_prompt))
    packed = bool(seg[-1] > 1)  # a boundary crossed: every call from here on carries segment ids and positions

    def packed_args(p, s):
        return (jnp.asarray(p, jnp.int32).reshape(1, -1), jnp.asarray(s, jnp.int32).reshape(1, -1)) if packed else ()

    logits, state = prefill(runner.params, jnp.asarray(prompt_ids[None], jnp.int32), state, *packed_args(pos, seg))
    doc, at, last = int(seg[-1]), int(pos[-1]), int(prompt_ids[-1])  # the last token fed: its document, position
    key = jax.random.key(seed)
    key0 = 0  # the step that first sampled from the current document's context: its keys count from there
    out, times = [], []
    for i in range(num_tokens):
        t0 = time.perf_counter()
        opens = apart and last == eos_id  # the token sampled now (from the closed document's logits) opens the next
        doc, at = (doc + 1, 0) if opens else (doc, at + 1)
        packed = packed or opens
        tok, logits, state = step(runner.params, logits, state, jax.random.fold_in(key, i - key0),
                                  *packed_args(at, doc))
        key0 = i + 1 if opens else key0
        tok = last = int(tok[0])
        times.append(time.perf_counter() - t0)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
    return np.asarray(out), np.asarray(times)


def new_output_path(workdir, step: int, seed: int, output: str | None) -> Path:
    """Where this run's sample goes: ``output`` if given (it must not exist), else the first free
    ``WORKDIR/samples/step<N>_seed<S>[-<k>].txt``. The file is created here (exclusively), so two
    runs never write the same file."""

    if output:
        path = Path(output)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            if path.parent.is_dir():
                raise ConfigError(f"--output {path} exists; samples are never overwritten, choose a new name") from None
            raise ConfigError(f"--output {path}: {path.parent} is not a folder; choose a path in a folder") from None
        except OSError as e:
            raise ConfigError(f"--output {path} cannot be created ({e.strerror or e}); choose a writable path") from None
        return path
    folder = Path(workdir) / "samples"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file, not the folder of samples; move it aside or give --output")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {folder} ({e.strerror or e}); fix it or give --output") from None
    for k in range(1, 100_000):
        path = folder / (f"step{int(step)}_seed{int(seed)}.txt" if k == 1 else f"step{int(step)}_seed{int(seed)}-{k}.txt")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise ConfigError(f"cannot create {path} ({e.strerror or e}); fix the folder or give --output") from None
    raise ConfigError(f"{folder} holds too many samples of step {step}, seed {seed}; use --output")


def encode_prompt(tok, prompt: str) -> np.ndarray:
    try:
        ids = np.asarray(tok.encode(prompt), np.int32)
    except (UnicodeError, LongctxError, ValueError) as e:
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ConfigError(f"the prompt cannot be encoded by the {tok.name!r} tokenizer ({why}); "
                          "give text in UTF-8 that the tokenizer covers") from None
    if ids.size == 0:
        raise ConfigError("the prompt is empty; give --prompt TEXT or --prompt_file FILE")
    return ids


def read_prompt_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise ConfigError(f"--prompt_file {path} is longer than {MAX_PROMPT_BYTES:,} bytes; give a shorter prompt")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt_file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read --prompt_file {path}: {e.strerror or e}") from None


MAX_PROMPT_BYTES = 1 << 24


def sample_run(workdir, *, step: int | None = None, overrides: dict | None = None, prompt_file: str | None = None,
               output: str | None = None, quiet: bool = False, progress: bool = True) -> dict:
    """Restore ``workdir``'s newest valid checkpoint (or ``step``), sample per its ``sample``
    config with ``overrides`` (``{'sample.temperature': 0.5, ...}``), stream the text unless
    ``quiet``, and write the sample and a JSON report to a new file."""

    prompt_text = read_prompt_file(prompt_file) if prompt_file else None
    runner = Runner.from_workdir(workdir, step=step, overrides=overrides)
    check_sampling(runner)
    sc = runner.cfg.sample
    tok = runner.load_tokenizer(progress=progress)
    prompt = sc.prompt if prompt_text is None else prompt_text
    ids = encode_prompt(tok, prompt)
    n = sc.num_tokens
    m = runner.cfg.model
    if m.positions == "learned" and ids.size + n > m.max_len:
        raise ConfigError(f"the prompt ({ids.size} tokens) and num_tokens={n} exceed the model's learned positions "
                          f"(model.max_len={m.max_len}); shorten the prompt or lower --num_tokens")
    settings = {"temperature": sc.temperature, "top_k": sc.top_k, "top_p": sc.top_p, "seed": sc.seed}
    eos = document_end_id(tok)
    if eos is not None and not keeps_documents_apart(m) and eos in ids[:-1].tolist():
        print(f"note: the prompt holds several documents, but {attention_label(m)} takes no segment ids: they run "
              "on in one context (each would start afresh with methods that take them)", flush=True)
    folder_existed = output is not None or (Path(workdir) / "samples").is_dir()
    out_path = new_output_path(workdir, runner.step, sc.seed, output)
    try:
        return _sample_to(out_path, runner, tok, prompt, ids, n, settings, eos, quiet=quiet, progress=progress)
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code == 130:  # stopped by Ctrl-C: the tokens so far were written
            raise
        out_path.unlink(missing_ok=True)  # no empty or half-written sample is left behind
        out_path.with_suffix(".json").unlink(missing_ok=True)
        if not folder_existed:
            try:
                out_path.parent.rmdir()
            except OSError:
                pass
        raise


def check_sampling(runner) -> None:
    """What sampling needs of a run: a causal decoder, and ``top_k`` within its vocabulary."""
    m, sc = runner.cfg.model, runner.cfg.sample
    if m.kind == "encoder":
        raise ConfigError("this run is an encoder (masked LM, model.kind='encoder'); it cannot sample text left to "
                          "right: fill masked bytes with longctx-fill, or sample from a decoder run")
    if not m.causal:
        raise ConfigError("this run's model is not causal (model.causal=False); sampling needs a causal decoder")
    if sc.top_k > m.vocab_size:
        raise ConfigError(f"sample.top_k={sc.top_k} exceeds the vocabulary ({m.vocab_size} tokens); "
                          f"use 0 (no filter) or at most {m.vocab_size}")


def continuation(tok, ids, out) -> str:
    """The text ``out`` adds after ``ids``: decoded in context (a word-level or SentencePiece tokenizer puts the
    spaces between tokens, which decoding ``out`` alone, or token by token, loses)."""
    ids, out = [int(t) for t in ids], [int(t) for t in out]
    base, full = tok.decode(ids), tok.decode(ids + out)
    return full[len(base):] if full.startswith(base) else tok.decode(out)


class TextStream:
    """Streams tokens as text, each decoded after the last ``context`` tokens (:func:`continuation`); a token whose
    text is not settled yet (a partial UTF-8 character) waits for the next."""

    def __init__(self, tok, ids, write, context: int = 8):
        self.tok, self.write, self.context = tok, write, context
        self.anchor, self.pending = [int(t) for t in ids][-context:], []

    def __call__(self, t: int) -> None:
        self.pending.append(int(t))
        base = self.tok.decode(self.anchor)
        full = self.tok.decode(self.anchor + self.pending)
        if full.startswith(base) and not full.endswith("\ufffd"):
            self.write(full[len(base):])
            self.anchor, self.pending = (self.anchor + self.pending)[-self.context:], []

    def flush(self) -> None:
        if self.pending:
            self.write(continuation(self.tok, self.anchor, self.pending))
            self.anchor, self.pending = (self.anchor + self.pending)[-self.context:], []


def _write_sample(out_path, text: str, report: dict) -> None:
    try:
        out_path.write_text(text)
        out_path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    except OSError as e:
        raise ConfigError(f"could not write the sample to {out_path} ({e.strerror or e})") from None


def _sample_to(out_path, runner, tok, prompt, ids, n, settings, eos, *, quiet, progress: bool = False):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # quiet: no text on stdout, so a bar on stderr says how far the sample is (progress)
    bar = tqdm(total=n, desc="sample", unit="tok", disable=not (quiet and progress), leave=False)
    one_byte = getattr(tok, "one_token_per_byte", False)

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    stream = TextStream(tok, ids, write)
    sampled = []  # the tokens so far: a stopped sample keeps them

    def on_token(t):
        sampled.append(t)
        if quiet:
            bar.update(1)
            return
        if one_byte:
            write(decoder.decode(bytes([t])))
        else:
            stream(t)

    if not quiet:
        sys.stdout.write(prompt)
    t0 = time.time()
    try:
        with bar:
            out, times = generate(runner, ids, n, on_token=on_token, eos_id=eos, **settings)
    except KeyboardInterrupt:  # Ctrl-C: the tokens sampled so far are the sample
        text = prompt + (bytes(sampled).decode("utf-8", errors="replace") if one_byte else
                         continuation(tok, ids, sampled))
        _write_sample(out_path, text, {"step": runner.step, "prompt_tokens": int(ids.size), "num_tokens": len(sampled),
                                       "requested_tokens": int(n), "stopped": True, **settings})
        print(f"\n\nstopped after {len(sampled):,} of {n:,} tokens; wrote {out_path}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    total = time.time() - t0
    if not quiet and not one_byte:
        stream.flush()
    text = prompt + (tok.decode_bytes(out).decode("utf-8", errors="replace") if one_byte else
                     continuation(tok, ids, out))
    k = max(1, min(256, n // 8))
    first, last = float(np.median(times[1 : k + 1] if n > k + 1 else times)), float(np.median(times[-k:]))
    report = {
        "step": runner.step, "prompt_tokens": int(ids.size), "num_tokens": int(n), "seconds": total,
        "tokens_per_sec": n / total, "median_token_seconds_start": first, "median_token_seconds_end": last,
        "end_over_start": last / first, "attention": runner.cfg.model.attention.name, **settings,
    }
    if eos is not None:  # documents of the prompt and the sample, and whether each started afresh
        report["documents"] = int(documents(np.concatenate([ids, out]), eos)[0][-1])
        report["documents_apart"] = keeps_documents_apart(runner.cfg.model)
    _write_sample(out_path, text, report)
    print(f"\n\n[{n} tokens in {total:.1f}s, {report['tokens_per_sec']:.1f} tokens/s with compilation and the "
          f"prompt's prefill; decoding alone (median per token) {first * 1e3:.2f} ms at the start, {last * 1e3:.2f} ms "
          f"at the end (x{report['end_over_start']:.2f}); wrote {out_path}]")
    return {**report, "path": str(out_path)}

