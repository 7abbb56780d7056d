"""``longctx-sample``: prefill a prompt, then decode token by token with the
model's own state (never re-running the prefix), streaming the text."""

from __future__ import annotations

import codecs
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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
    graphdef = runner.graphdef

    @jax.jit
    def prefill(params, tokens, state):
        model = nnx.merge(graphdef, *params)
        logits, state, _ = model(tokens, state, deterministic=True)
        return logits[:, -1], state

    @jax.jit
    def step(params, logits, state, key):
        if temperature == 0:
            tok = jnp.argmax(logits, axis=-1)
        else:
            tok = jax.random.categorical(key, filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p))
        model = nnx.merge(graphdef, *params)
        new_logits, state, _ = model(tok[:, None].astype(jnp.int32), state, deterministic=True)
        return tok, new_logits[:, -1], state

    return prefill, step


def generate(runner, prompt_ids: np.ndarray, num_tokens: int, *, temperature=0.8, top_k=0, top_p=1.0, seed=0,
             on_token=None):
    """Returns (token ids, per-token seconds). Decoding state capacity = prompt + num_tokens."""
    prefill, step = make_decoder(runner, temperature=temperature, top_k=top_k, top_p=top_p)
    n_prompt = len(prompt_ids)
    state = runner.init_state(1, n_prompt + num_tokens)
    logits, state = prefill(runner.params, jnp.asarray(prompt_ids[None], jnp.int32), state)
    key = jax.random.key(seed)
    out, times = [], []
    for i in range(num_tokens):
        t0 = time.perf_counter()
        tok, logits, state = step(runner.params, logits, state, jax.random.fold_in(key, i))
        tok = int(tok[0])
        times.append(time.perf_counter() - t0)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
    return np.asarray(out), np.asarray(times)


def main(argv=None) -> int:
    import argparse

    from longctx import runtime
    from longctx.errors import ConfigError

    p = argparse.ArgumentParser(prog="longctx-sample", description="Sample text from a checkpoint with stateful decoding.")
    p.add_argument("--workdir", required=True)
    p.add_argument("--step", type=int, default=None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt_file", default=None)
    p.add_argument("--num_tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--output", default=None, help="file for the sample (default: WORKDIR/samples/...)")
    p.add_argument("--quiet", action="store_true", help="do not stream the text")
    args = p.parse_args(argv)
    with runtime.user_errors():
        runner = runtime.Runner.from_workdir(args.workdir, step=args.step)
        sc = runner.cfg.sample
        tok = runner.tokenizer
        if tok is None:
            from longctx.data.prepare import prepare

            tok, _, _ = prepare(runner.cfg.data, [runner.cfg.eval.split])
        prompt = sc.prompt if args.prompt is None else args.prompt
        if args.prompt_file:
            try:
                prompt = Path(args.prompt_file).read_text()
            except OSError as e:
                raise ConfigError(f"cannot read --prompt_file: {e}") from None
        ids = np.asarray(tok.encode(prompt), np.int32)
        if ids.size == 0:
            raise ConfigError("the prompt is empty; give --prompt TEXT or --prompt_file FILE")
        n = sc.num_tokens if args.num_tokens is None else args.num_tokens
        settings = {
            "temperature": sc.temperature if args.temperature is None else args.temperature,
            "top_k": sc.top_k if args.top_k is None else args.top_k,
            "top_p": sc.top_p if args.top_p is None else args.top_p,
            "seed": sc.seed if args.seed is None else args.seed,
        }
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        one_byte = getattr(tok, "one_token_per_byte", False)

        def on_token(t):
            if args.quiet:
                return
            text = decoder.decode(bytes([t])) if one_byte else tok.decode([t])
            sys.stdout.write(text)
            sys.stdout.flush()

        if not args.quiet:
            sys.stdout.write(prompt)
        t0 = time.time()
        out, times = generate(runner, ids, n, on_token=on_token, **settings)
        total = time.time() - t0
        text = prompt + (tok.decode_bytes(out).decode("utf-8", errors="replace") if one_byte else tok.decode(out))
        k = max(1, min(256, n // 8))
        first, last = float(np.median(times[1 : k + 1] if n > k + 1 else times)), float(np.median(times[-k:]))
        report = {
            "step": runner.step, "prompt_tokens": int(ids.size), "num_tokens": int(n), "seconds": total,
            "tokens_per_sec": n / total, "median_token_seconds_start": first, "median_token_seconds_end": last,
            "end_over_start": last / first, "attention": runner.cfg.model.attention.name, **settings,
        }
        out_path = Path(args.output) if args.output else Path(args.workdir) / "samples" / f"step{runner.step}_seed{settings['seed']}.txt"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)
        out_path.with_suffix(".json").write_text(json.dumps(report, indent=1))
        print(f"\n\n[{n} tokens in {total:.1f}s: {report['tokens_per_sec']:.1f} tokens/s; per-token time "
              f"{first * 1e3:.2f} ms at the start, {last * 1e3:.2f} ms at the end (x{report['end_over_start']:.2f}); "
              f"wrote {out_path}]")
    return 0
