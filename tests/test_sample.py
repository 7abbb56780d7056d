"""Sampling: filters, stateful decoding equals recomputing the prefix, and a document boundary (of the prompt or
sampled) is a fresh start."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.sample import document_end_id, documents, filter_logits, generate
from tests.test_evaluate import make_runner


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert np.isfinite(np.asarray(k2)).tolist() == [[True, True, False, False]]
    p = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.7)
    assert np.isfinite(np.asarray(p)).tolist() == [[True, True, False, False]]
    p1 = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.4)
    assert np.isfinite(np.asarray(p1)).tolist() == [[True, False, False, False]]


def test_greedy_stateful_decoding_equals_full_recompute(tiny_cfg):
    _, runner, _ = make_runner(tiny_cfg)
    prompt = np.array([100, 101, 32, 40], np.int32)
    out, times = generate(runner, prompt, 12, temperature=0.0)
    assert len(times) == 12
    # one full pass over prompt + generated tokens: causal, so the logits at position i are the
    # recomputed prefix's, and greedy decoding must have picked their argmax (one compilation)
    seq = np.concatenate([prompt, np.asarray(out)])
    logits, _, _ = runner.model()(jnp.asarray(seq[None, :-1], jnp.int32))
    want = np.asarray(jnp.argmax(logits[0], axis=-1))[len(prompt) - 1:]
    assert out.tolist() == want.tolist()


def test_sampling_is_reproducible_by_seed(tiny_cfg):
    _, runner, _ = make_runner(tiny_cfg)
    prompt = np.array([100, 101], np.int32)
    a, _ = generate(runner, prompt, 10, temperature=1.0, seed=3)
    b, _ = generate(runner, prompt, 10, temperature=1.0, seed=3)
    assert a.tolist() == b.tolist()
    _ = jax


def _first_new(tokens, prompt, at_least: int = 1):
    """(index, token): the first sampled token from ``at_least`` on that is neither in the prompt nor sampled
    before it (as an end-of-document id, it ends a document there and nowhere earlier)."""
    for j in range(at_least, len(tokens)):
        if tokens[j] not in prompt.tolist() and tokens[j] not in tokens[:j].tolist():
            return j, int(tokens[j])
    raise AssertionError(f"no new token in {tokens}")


def test_a_prompt_of_several_documents_continues_its_last_from_a_fresh_start(tiny_cfg):
    """A prompt of two documents (the first closed by the end-of-document id 10): greedy decoding continues the
    second exactly as a prompt of the second alone does; in one context (no end-of-document id) it does not."""
    _, runner, _ = make_runner(tiny_cfg)
    first, second = np.array([100, 101, 32, 40, 10], np.int32), np.array([104, 105, 33], np.int32)
    both = np.concatenate([first, second])
    got, _ = generate(runner, both, 12, temperature=0.0, eos_id=10)
    fresh, _ = generate(runner, second, 12, temperature=0.0, eos_id=10)
    assert got.tolist() == fresh.tolist()
    joined, _ = generate(runner, both, 12, temperature=0.0)
    assert joined.tolist() != fresh.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_past_an_end_of_document_token_starts_a_fresh_document(tiny_cfg, temperature):
    """A sample that emits the end-of-document id at step j: up to the token after it (sampled from its logits) it
    is the sample without documents; from there it is the sample of a fresh start from that token with the same key
    (at temperature 1 the keys too count from the new document's start)."""
    _, runner, _ = make_runner(tiny_cfg)
    prompt, n = np.array([100, 101, 32, 40], np.int32), 14
    plain, _ = generate(runner, prompt, n, temperature=temperature, seed=5)
    j, eos = _first_new(plain, prompt)
    got, _ = generate(runner, prompt, n, temperature=temperature, seed=5, eos_id=eos)
    assert got[: j + 2].tolist() == plain[: j + 2].tolist()  # one document until the boundary: the plain calls
    fresh, _ = generate(runner, got[j + 1 : j + 2], n - j - 2, temperature=temperature, seed=5, eos_id=eos)
    assert got[j + 2 :].tolist() == fresh.tolist()
    if temperature == 0.0:  # the plain sample's context runs across the boundary and continues otherwise
        assert plain[j + 2 :].tolist() != fresh.tolist()


def test_documents_of_a_token_stream():
    seg, pos = documents(np.array([5, 9, 10, 7, 10, 10, 3]), 10)
    assert seg.tolist() == [1, 1, 1, 2, 2, 3, 4] and pos.tolist() == [0, 1, 2, 0, 1, 0, 0]


def test_the_end_of_document_token_of_a_tokenizer():
    """A boundary is the tokenizer's end-of-document token, unless it has none (bytes; sentencepiece's -1) or plain
    text encodes to it (the words tokenizer's <eos> ends every line)."""
    from types import SimpleNamespace

    def tok(eos, newline):
        return SimpleNamespace(eos_id=eos, encode=lambda text: np.asarray(newline if text == "\n" else [7]))

    assert document_end_id(tok(2, [13])) == 2
    assert document_end_id(tok(0, [0])) is None
    assert document_end_id(tok(-1, [13])) is None
    assert document_end_id(SimpleNamespace(encode=lambda text: [10])) is None


def test_decoding_calls_donate_the_state(tiny_cfg):
    """Prefill and every decoding step take the state donated (a step does not copy a KV cache sized for the
    whole sample): the state handed in is gone after the call, the returned one goes on; longctx-eval's forward
    likewise."""
    import warnings

    from longctx.sample import make_decoder

    _, runner, _ = make_runner(tiny_cfg)
    prefill, step = make_decoder(runner, temperature=0.0, top_k=0, top_p=1.0)
    state0 = runner.init_state(1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a donation XLA could not use would warn
        logits, state1 = prefill(runner.params, jnp.asarray([[100, 101]], jnp.int32), state0)
        _, _, state2 = step(runner.params, logits, state1, jax.random.key(0))
        x = jnp.zeros((1, 4), jnp.int32)
        _, state3 = runner.forward(runner.params, x, x, state2)
    for gone in (state0, state1, state2):
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(gone))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state3))


def test_sampled_text_keeps_the_spaces_a_tokenizer_puts_between_tokens():
    """A word-level tokenizer joins tokens with spaces, which decoding token by token (or the sample alone) lost
    (``w5w73w66``); a multi-byte character split over tokens is written once it is whole."""
    from longctx.sample import TextStream, continuation

    class Words:
        def decode(self, ids):
            return " ".join(f"w{int(i)}" for i in ids)

    class Bytes:  # each token one byte of UTF-8
        def decode(self, ids):
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    written = []
    stream = TextStream(Words(), [5], written.append)
    for t in (73, 66, 69):
        stream(t)
    stream.flush()
    assert "".join(written) == " w73 w66 w69" == continuation(Words(), [5], [73, 66, 69])
    written.clear()
    snow = "a\u2603b".encode()  # a 3-byte character between two ASCII ones
    stream = TextStream(Bytes(), [ord("x")], written.append)
    for t in snow:
        stream(t)
    stream.flush()
    assert written == ["a", "\u2603", "b"] and "".join(written) == continuation(Bytes(), [ord("x")], list(snow))


def test_ctrl_c_keeps_the_tokens_sampled_so_far(tiny_cfg, tmp_path, monkeypatch, capsys):
    """Ctrl-C while sampling: the sample so far is written with a report saying it stopped (it was deleted, with
    a traceback), exit status 130."""
    import json

    from longctx import sample

    _, runner, _ = make_runner(tiny_cfg)

    def interrupted(runner, ids, n, *, on_token, **kw):
        for t in b"hi there":
            on_token(t)
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "generate", interrupted)
    out = tmp_path / "s.txt"
    with pytest.raises(SystemExit) as e:
        sample._sample_to(out, runner, runner.tokenizer, "ab", np.array([97, 98]), 100,
                          {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0}, None, quiet=True)
    assert e.value.code == 130 and out.read_text() == "abhi there"
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["stopped"] and report["num_tokens"] == 8 and report["requested_tokens"] == 100
    assert f"stopped after 8 of 100 tokens; wrote {out}" in capsys.readouterr().err
