"""Packed rows at model level (``data.packing='segments'``): the loss of a packed batch is the token-weighted loss of
its documents run alone, with positions restarting at each document and the windows of a row carrying the state
across document boundaries (decoder), or each document encoded alone (masked LM); evaluating a split of several
documents scores each from a fresh start; the combinations that cannot take packed rows are refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from longctx import attention
from longctx.config import base_config, validate
from longctx.data import masking
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.train.step import make_mlm_loss_fn, make_packed_loss_fn, make_train_step, split_model, target_weights
from tests.conftest import xla_flags
from tests.models.test_decoder import small_model_cfg

ROWS = ((5, 11, 17), (17, 5, 11))  # document lengths per row: T + 1 = 33 tokens, boundaries at different places
T = 32
WINDOW = 8  # windows of the row; documents cross their edges


def _batch():
    seg = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in ROWS]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in ROWS]).astype(np.int32)
    tokens = np.asarray(jax.random.randint(jax.random.key(0), seg.shape, 0, 50), np.int32)
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


def _alone_nll(model, batch):
    """Per target [B, T] nll of each document run alone (0 at the targets that open the next document)."""
    tokens = np.asarray(batch["tokens"])
    call = nnx.jit(lambda m, t: m(t)[0])
    out = np.zeros((len(ROWS), T), np.float64)
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            doc = jnp.asarray(tokens[b:b + 1, start:start + n])
            logp = jax.nn.log_softmax(call(model, doc)[0, :-1].astype(jnp.float32), axis=-1)
            out[b, start:start + n - 1] = -np.take_along_axis(np.asarray(logp), np.asarray(doc[0, 1:, None]), -1)[:, 0]
            start += n
    return out


def _windowed_nll(model, batch, window):
    """Per target [B, T] nll of the packed rows run in windows of ``window`` tokens, the state carried."""
    tokens, seg, pos = (batch[k][:, :-1] for k in ("tokens", "segment_ids", "positions"))
    targets = batch["tokens"][:, 1:]

    @nnx.jit
    def run(m, t, y, p, s, state):
        h, state, _ = m.run(t, state, positions=p, segment_ids=s)
        return m.nll(h, y), state

    state, outs = model.init_state(len(ROWS), T), []
    for a in range(0, T, window):
        sl = slice(a, a + window)
        nll, state = run(model, tokens[:, sl], targets[:, sl], pos[:, sl], seg[:, sl], state)
        outs.append(nll)
    return np.asarray(jnp.concatenate(outs, axis=1), np.float64)


@pytest.mark.parametrize("positions", ["rotary", "learned", "sinusoidal"])
def test_packed_rows_score_each_document_as_if_alone(positions):
    """Windows of 8 carrying the dense KV cache: every in-document target's nll equals its document's alone."""
    model = build_model(small_model_cfg(positions), seed=1)
    batch = _batch()
    w = np.asarray(target_weights(batch["segment_ids"]))
    assert w.sum() == sum(n - 1 for r in ROWS for n in r)  # one target lost per document (its successor's first)
    want = _alone_nll(model, batch)
    got = _windowed_nll(model, batch, WINDOW)
    np.testing.assert_allclose(got * w, want, atol=2e-5, rtol=2e-5)
    # without segment ids the same rows see across documents: the law above is not met by accident
    plain = nnx.jit(lambda m, t, y: m.nll(m.run(t)[0], y))(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])
    assert np.max(np.abs(np.asarray(plain) * w - want)) > 1e-3


@pytest.mark.slow
def test_packed_loss_and_gradient_are_the_documents_token_weighted():
    """The packed loss (one window) equals sum over documents of (targets * mean nll) / all targets, and so does its
    gradient (each document's own loss, run alone, weighted by its share of the targets)."""
    model = build_model(small_model_cfg("rotary"), seed=2)
    graphdef, params, nongrad, rest = split_model(model)
    batch = _batch()
    seg, pos, tok = batch["segment_ids"], batch["positions"], batch["tokens"]
    packed = make_packed_loss_fn(graphdef)

    def packed_loss(p):
        return packed(p, nongrad, rest, tok[:, :-1], tok[:, 1:], pos[:, :-1], seg[:, :-1], target_weights(seg), None,
                      None)[0]

    def alone_loss(p):
        m = nnx.merge(graphdef, p, nongrad, rest)
        total, count = 0.0, 0
        for b, row in enumerate(ROWS):
            start = 0
            for n in row:
                doc = tok[b:b + 1, start:start + n]
                total = total + jnp.sum(m.nll(m.run(doc[:, :-1])[0], doc[:, 1:]))
                count += n - 1
                start += n
        return total / count

    lp, gp = jax.jit(jax.value_and_grad(packed_loss))(params)
    la, ga = jax.jit(jax.value_and_grad(alone_loss))(params)
    np.testing.assert_allclose(float(lp), float(la), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(ga)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_windowed_train_step_reports_each_windows_document_loss(microbatches):
    """The train step (packed=True, windows of 8 carrying the state, lr 0; the rows in one batch or in two
    micro-batches): each window's reported loss is the mean of its in-document targets' nll of the documents
    alone."""
    model = build_model(small_model_cfg("rotary"), seed=1)
    graphdef, params, nongrad, rest = split_model(model)
    tx = optax.sgd(0.0)
    step = jax.jit(make_train_step(graphdef, tx, seq_len=T, window=WINDOW, skip_nonfinite=True, packed=True,
                                   microbatches=microbatches))
    batch = _batch()
    *_, metrics = step(params, nongrad, rest, tx.init(params), batch, jax.random.key(0))
    want, w = _alone_nll(model, batch), np.asarray(target_weights(batch["segment_ids"]))
    per_window = [(want[:, a:a + WINDOW] * w[:, a:a + WINDOW]).sum() / w[:, a:a + WINDOW].sum()
                  for a in range(0, T, WINDOW)]
    np.testing.assert_allclose(np.asarray(metrics["ce"]), per_window, rtol=2e-5)


def _assert_packed_rows_score_documents_alone(cfg):
    """A model of ``cfg`` fed the packed batch in one call: every in-document target's nll equals its document's
    alone, and differs without the segment ids."""
    model = build_model(cfg, seed=1)
    batch = _batch()
    tokens, seg, pos = (batch[k][:, :-1] for k in ("tokens", "segment_ids", "positions"))
    got = nnx.jit(lambda m, t, p, s, y: m.nll(m.run(t, positions=p, segment_ids=s)[0], y))(
        model, tokens, pos, seg, batch["tokens"][:, 1:])
    w = np.asarray(target_weights(batch["segment_ids"]))
    want = _alone_nll(model, batch)
    np.testing.assert_allclose(np.asarray(got) * w, want, atol=2e-5, rtol=2e-5)
    plain = nnx.jit(lambda m, t, y: m.nll(m.run(t)[0], y))(model, tokens, batch["tokens"][:, 1:])
    assert np.max(np.abs(np.asarray(plain) * w - want)) > 1e-3


@pytest.mark.slow
def test_packed_eva_rows_score_each_document_as_if_alone():
    """EVA (its reference serves packed rows; a packed row in one call): every in-document target's nll equals its
    document's alone, blocks of 8 and chunks of 4 cut by the documents."""
    cfg = small_model_cfg("rotary")
    cfg.attention.name = "eva"
    cfg.attention.eva.update(window_size=8, chunk_size=4)
    _assert_packed_rows_score_documents_alone(cfg)


@pytest.mark.slow
def test_packed_transformer_vq_gau_rows_score_each_document_as_if_alone():
    """Transformer-VQ in the paper's GAU block (its reference serves packed rows; a packed row in one call): every
    in-document target's nll equals its document's alone, blocks of 4 cut by the documents."""
    cfg = small_model_cfg("sinusoidal", block="gau")
    cfg.attention.name = "transformer_vq"
    cfg.attention.transformer_vq.update(block_len=4, codebook_size=8)
    _assert_packed_rows_score_documents_alone(cfg)


def _segments_cfg(**model):
    c = base_config()
    c.data.packing = "segments"
    for k, v in model.items():
        c.model[k] = v
    return c


def test_config_refuses_what_cannot_take_packed_rows(monkeypatch):
    validate(_segments_cfg())  # a dense decoder takes them
    validate(_segments_cfg(kind="encoder", causal=False))  # and a dense encoder (masked LM)
    c = _segments_cfg(kind="encoder", causal=False)
    c.model.attention.name = "vcc"
    validate(c)  # and VCC's encoder stack (docs/methods/vcc.md)
    monkeypatch.setattr(attention.get_class("vcc"), "takes_segments", False)  # standing in for a method without
    with pytest.raises(ConfigError, match=r"^vcc: packed rows \(data.packing='segments'\) are not supported"):
        validate(c)
    c = _segments_cfg()
    c.mesh.sequence = 2
    validate(c)  # sequence parallelism splits the segment ids and positions with the tokens
    c = _segments_cfg()
    c.data.source = "mqar"
    c.data.tokenizer = "bytes"
    with pytest.raises(ConfigError, match="^data.packing='segments' applies to prepared corpora"):
        validate(c)


def test_a_block_whose_method_takes_no_segment_ids_refuses_them(monkeypatch):
    """A pattern whose other layers' method takes no segment ids (every registered method takes them: KDEformer
    stands in for one without): config validation and the model call refuse."""
    monkeypatch.setattr(attention.get_class("kdeformer"), "takes_segments", False)
    cfg = small_model_cfg("rotary", num_layers=2)
    cfg.attention.pattern = ("kdeformer", "dense")
    model = build_model(cfg, seed=0)
    batch = _batch()
    with pytest.raises(ConfigError, match=r"^kdeformer: packed rows \(data.packing='segments'\) are not supported "
                                          r"yet; use data.packing='document'$"):
        model.run(batch["tokens"][:, :-1], positions=batch["positions"][:, :-1],
                  segment_ids=batch["segment_ids"][:, :-1])
    c = _segments_cfg()
    c.model.attention.pattern = ("kdeformer", "dense")
    with pytest.raises(ConfigError, match="^kdeformer: packed rows"):
        validate(c)


# ---- the encoder (masked LM): bidirectional attention within each document

ENC_ROWS = ((5, 11, 16), (16, 5, 11))  # T = 32 tokens per row


def _encoder_batch(mask_id: int):
    seg = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in ENC_ROWS]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in ENC_ROWS]).astype(np.int32)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), seg.shape, 0, mask_id), np.int32)
    mcfg = base_config().mlm
    mcfg.rate = 0.4  # 13 masked positions per row: every document of the rows gets some
    masked = masking.mask_rows(tokens, mcfg, seed=0, step=0, rows=np.arange(len(ENC_ROWS)), mask_id=mask_id)
    return masking.with_boundaries(masked, {"tokens": tokens, "segment_ids": seg, "positions": pos}), \
        masking.num_masked(T, mcfg.rate)


@pytest.mark.parametrize("positions", ["learned", pytest.param("rotary", marks=pytest.mark.slow)])
def test_packed_masked_lm_loss_is_the_documents_masked_token_weighted(positions):
    """The masked-LM loss of packed rows (same masks) equals the sum of each document's masked-token nll, run alone,
    over all masked tokens; without the segment ids the documents see each other and it does not."""
    model = build_model(small_model_cfg(positions, kind="encoder", causal=False), seed=4)
    graphdef, params, nongrad, rest = split_model(model)
    batch, n_mask = _encoder_batch(mask_id=49)
    assert set(batch) == {"inputs", "targets", "mask", "segment_ids", "positions"}
    mask = batch["mask"]
    loss = jax.jit(lambda b: make_mlm_loss_fn(graphdef, n_mask)(params, nongrad, rest, b, None, None)[1][0])
    got = float(loss({k: jnp.asarray(v) for k, v in batch.items()}))

    alone = nnx.jit(lambda m, x, y, k: m.nll(m.hidden(x, k)[0], y))
    total, count = 0.0, 0
    for b, row in enumerate(ENC_ROWS):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            nll = np.asarray(alone(model, jnp.asarray(batch["inputs"][b:b + 1, sl]),
                                   jnp.asarray(batch["targets"][b:b + 1, sl]), jnp.asarray(mask[b:b + 1, sl])))
            assert mask[b, sl].any()  # every document counts in the law
            total += float(nll[0][mask[b, sl]].sum())
            count += int(mask[b, sl].sum())
            start += n
    assert count == mask.sum()
    np.testing.assert_allclose(got, total / count, rtol=2e-5)
    unpacked = {k: jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask")}
    assert abs(float(loss(unpacked)) - total / count) > 1e-3


# ---- evaluation: a split of several documents is scored as its documents alone

EVAL_DOCS = (9, 14, 6, 17)


@pytest.mark.parametrize("protocol", ["stream", "sliding"])
def test_evaluating_a_split_scores_each_document_from_a_fresh_start(protocol):
    """``evaluate_split`` on a split of several documents (stream: windows of 8 carrying the dense KV cache; sliding:
    context 16, stride 8) with eval.reset='document' gives the loss of its documents each evaluated as a split of
    its own; the stream with eval.reset='never' carries the state across documents and does not."""
    from types import SimpleNamespace

    from longctx.data.prepare import TokenData
    from longctx.evaluate import evaluate_split
    from longctx.train.step import make_forward

    model = build_model(small_model_cfg("rotary"), seed=5)
    graphdef, *state = split_model(model)
    fwd = jax.jit(make_forward(graphdef))
    runner = SimpleNamespace(is_encoder=False, forward=lambda p, x, y, s: fwd(*p, x, y, s), params=tuple(state),
                             init_state=model.init_state, tokenizer_is_bytes=False, word_count=lambda data: None)
    ecfg = base_config().eval
    ecfg.protocol, ecfg.window, ecfg.row_len, ecfg.context, ecfg.stride, ecfg.batch_size = protocol, 8, 0, 16, 8, 2
    tokens = np.asarray(jax.random.randint(jax.random.key(6), (sum(EVAL_DOCS),), 0, 50), np.int32)
    starts = np.concatenate([[0], np.cumsum(EVAL_DOCS)]).astype(np.int64)

    def score(a, b, reset="document"):
        ecfg.reset = reset
        res, _ = evaluate_split(runner, TokenData(tokens[a:b], starts[(starts >= a) & (starts <= b)] - a, {}), ecfg,
                                progress=False)
        return res["nll_sum_nats"], res["tokens_scored"]

    whole, n_whole = score(0, len(tokens))
    alone = [score(a, b) for a, b in zip(starts[:-1], starts[1:])]
    assert n_whole == sum(n for _, n in alone) == sum(EVAL_DOCS) - len(EVAL_DOCS)
    np.testing.assert_allclose(whole, sum(s for s, _ in alone), rtol=2e-5)
    if protocol == "stream":
        across, n_across = score(0, len(tokens), reset="never")
        assert n_across == len(tokens) - 1 and abs(across - whole) > 1e-2


# ---- sequence parallelism: packed rows split over 8 simulated devices (a subprocess, so XLA_FLAGS takes effect)

SP_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, ml_collections
    from longctx.config import base_config, validate
    from longctx.data import masking
    from longctx.models.decoder import build_model
    from longctx.train import sequence_parallel, sharding
    from longctx.train.optim import make_optimizer
    from longctx.train.step import make_mlm_train_step, make_train_step, split_model

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)

    def packed_rows(B, L):  # documents of 1..12 tokens back to back, segment ids and positions restarting
        seg, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
        for b in range(B):
            t, d = 0, 1
            while t < L:
                n = min(int(rng.integers(1, 13)), L - t)
                seg[b, t:t + n], pos[b, t:t + n] = d, np.arange(n)
                t, d = t + n, d + 1
        return {"tokens": rng.integers(0, 63, (B, L)).astype(np.int32), "segment_ids": seg, "positions": pos}

    for kind in ("decoder", "encoder"):
        c = base_config()
        c.data.packing = "segments"
        c.model.kind, c.model.causal = kind, kind == "decoder"
        c.model.vocab_size, c.model.positions = 64, "rotary"
        c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.head_dim, c.model.d_ff = 32, 2, 2, 16, 64
        c.train.seq_len, c.train.batch_size, c.train.steps, c.train.warmup_steps = 32, 8, 10, 1
        c.train.window = 16 if kind == "decoder" else 0
        c.model.dropout = 0.0
        cfg = validate(c)
        rows = packed_rows(8, 33 if kind == "decoder" else 32)
        if kind == "encoder":
            n_mask = masking.num_masked(32, 0.25)
            mcfg = ml_collections.ConfigDict({**cfg.mlm.to_dict(), "rate": 0.25})
            rows = masking.with_boundaries(masking.mask_rows(rows["tokens"], mcfg, seed=0, step=0, rows=np.arange(8),
                                                             mask_id=63), rows)
        # the decoder: XLA's split (dense's 'auto') and composed states; the encoder: XLA's split
        meshes = [((1, 1, 1, 1), "auto"), ((2, 1, 1, 4), "auto"), ((1, 1, 1, 8), "compose")][:3 if kind == "decoder" else 2]
        results = []
        for shape, seq_mode in meshes:
            mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(zip(sharding.AXES, shape))),
                                      jax.devices()[:int(np.prod(shape))])
            model = build_model(cfg.model, seed=0, execution=cfg.execution)
            graphdef, params, nongrad, rest = split_model(model)
            tx = make_optimizer(cfg.train)
            opt = tx.init(params)
            plan = sharding.Plan(mesh, params, nongrad, rest, tx, opt)
            params, nongrad, rest, opt = plan.put(params, nongrad, rest, opt)
            if kind == "decoder":
                mode, hidden = sequence_parallel.train_hidden(model, mesh, window=16, seq_len=32, mode=seq_mode,
                                                              fold_key=False)
                print("MODE", shape, mode, flush=True)
                step = make_train_step(graphdef, tx, seq_len=32, window=16, skip_nonfinite=False,
                                       constrain=plan.constrain, hidden=hidden, packed=True)
            else:
                step = make_mlm_train_step(graphdef, tx, num_masked=n_mask, skip_nonfinite=False,
                                           constrain=plan.constrain, row_mesh=mesh if shape[3] > 1 else None)
            batch = {k: sharding.shard_batch(mesh, v) for k, v in rows.items()}
            p, _, _, m = plan.jit_step(step, donate=False)(params, nongrad, rest, opt, batch, jax.random.key(0))
            results.append((shape, jax.device_get(p), np.asarray(m["ce"])))
        _, p1, l1 = results[0]
        for shape, p, l in results[1:]:
            np.testing.assert_allclose(l, l1, rtol=2e-5, err_msg=f"{kind} {shape} loss")
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p1)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=f"{kind} {shape} params")
        print("OK", kind, l1, flush=True)
    """
)


@pytest.mark.slow  # a subprocess on 8 simulated devices compiling six train steps
def test_packed_rows_under_sequence_parallelism_equal_one_device():
    """A packed batch's train step (decoder: two windows carrying the state; encoder: the masked LM) with the rows
    split over the mesh's ``sequence`` axis (4 devices by XLA's partitioner; 8 by composed states) updates the
    parameters as on one device, where the loss is each document's alone (the tests above)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", SP_SCRIPT], capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0 and r.stdout.count("OK") == 2, r.stdout + r.stderr[-4000:]
    assert "MODE (2, 1, 1, 4) xla" in r.stdout and "MODE (1, 1, 1, 8) compose" in r.stdout, r.stdout


SP_METHODS_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, ml_collections
    from longctx import attention
    from longctx.config import base_config, validate
    from longctx.errors import ConfigError
    from longctx.models.decoder import build_model
    from longctx.train import sequence_parallel, sharding
    from longctx.train.optim import make_optimizer
    from longctx.train.step import make_train_step, split_model

    L, W, B = 64, 32, 4
    rng = np.random.default_rng(0)
    seg, pos = np.zeros((B, L + 1), np.int32), np.zeros((B, L + 1), np.int32)
    for b in range(B):  # documents of 1..19 tokens back to back, crossing the slices and the windows
        t, d = 0, 1
        while t < L + 1:
            n = min(int(rng.integers(1, 20)), L + 1 - t)
            seg[b, t:t + n], pos[b, t:t + n] = d, np.arange(n)
            t, d = t + n, d + 1
    rows = {"tokens": rng.integers(0, 63, (B, L + 1)).astype(np.int32), "segment_ids": seg, "positions": pos}

    for method in attention.names():
        cls = attention.get_class(method)
        if not (cls.supports_causal and cls.takes_segments) or cls.stack_wrapper(causal=True):
            continue
        case = next(c for c in cls.contract_cases().values() if "causal" in c.directions)
        c = base_config()
        c.data.packing = "segments"
        c.model.vocab_size, c.model.positions, c.model.dropout = 64, "rotary", 0.0
        c.model.d_model, c.model.num_layers, c.model.d_ff = 32, 2, 64
        c.model.num_heads, c.model.head_dim = case.num_heads, case.head_dim
        c.model.attention.name = method
        c.model.attention[method] = {k: v for k, v in dict(case.cfg).items() if k not in cls.EXECUTION_KEYS}
        if cls.allowed_positions is not None and c.model.positions not in cls.allowed_positions:
            c.model.positions = "sinusoidal" if "sinusoidal" in cls.allowed_positions else cls.allowed_positions[0]
        c.train.seq_len, c.train.batch_size, c.train.steps, c.train.warmup_steps, c.train.window = L, B, 10, 1, W
        cfg = validate(c)
        results = []
        for shape, mode in (((1, 1, 1, 1), "auto"), ((1, 1, 1, 4), "xla"), ((1, 1, 1, 4), "compose")):
            mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(zip(sharding.AXES, shape))),
                                      jax.devices()[:int(np.prod(shape))])
            model = build_model(cfg.model, seed=0, execution=cfg.execution)
            graphdef, params, nongrad, rest = split_model(model)
            tx = make_optimizer(cfg.train)
            opt = tx.init(params)
            plan = sharding.Plan(mesh, params, nongrad, rest, tx, opt)
            params, nongrad, rest, opt = plan.put(params, nongrad, rest, opt)
            try:
                got, hidden = sequence_parallel.train_hidden(model, mesh, window=W, seq_len=L, mode=mode,
                                                             fold_key=False, packed=True)
            except ConfigError as e:
                assert "\\n" not in str(e) and sequence_parallel.packed_refusals(model), str(e)
                print("REFUSED", method, mode, flush=True)
                continue
            step = make_train_step(graphdef, tx, seq_len=L, window=W, skip_nonfinite=False,
                                   constrain=plan.constrain, hidden=hidden, packed=True)
            batch = {k: sharding.shard_batch(mesh, v) for k, v in rows.items()}
            p, _, _, m = plan.jit_step(step, donate=False)(params, nongrad, rest, opt, batch, jax.random.key(0))
            results.append((shape, got, jax.device_get(p), np.asarray(m["ce"])))
        _, _, p1, l1 = results[0]
        for shape, got, p, l in results[1:]:
            np.testing.assert_allclose(l, l1, rtol=2e-5, err_msg=f"{method} {shape} {got} loss")
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p1)):
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=f"{method} {shape} {got} params")
            print("OK", method, got, flush=True)
    """
)


@pytest.mark.slow  # a subprocess on 4 simulated devices compiling three train steps per method
def test_every_methods_packed_rows_under_sequence_parallelism_equal_one_device():
    """Every causal method that takes segment ids (each its contract case's settings): a packed batch's train step
    (documents of 1-19 tokens, two windows carrying the state) with the rows split over 4 devices by XLA's
    partitioner updates the parameters as on one device; composed states split them only where the core declares
    ``sequence_compose_packed``, and refuse in one line otherwise."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", SP_METHODS_SCRIPT], capture_output=True, text=True, timeout=2400,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    for name in attention.names():
        cls = attention.get_class(name)
        if cls.supports_causal and cls.takes_segments and not cls.stack_wrapper(causal=True):
            assert f"OK {name} xla" in r.stdout, r.stdout


# every method whose causal core takes segment ids and carries a state, with its blocks (the paper's GAU for
# Transformer-VQ)
CARRIED = [("dense", "transformer"), ("swa", "transformer"), ("transformer_vq", "gau"), ("eva", "transformer"),
           ("kdeformer", "transformer"), ("fma", "transformer")]


@pytest.mark.parametrize("name,block", CARRIED, ids=[n for n, _ in CARRIED])
def test_a_packed_row_decoded_token_by_token_scores_its_documents_alone(name, block):
    """A packed row fed one token at a time (a sampler past a document's end) with its positions and segment ids:
    the same logits as the packed full pass. Ids are any int32, 0 included (it also marks a state that has seen no
    segment ids: continuing an empty state is starting afresh)."""
    from tests.models.test_scan_layers import V, model_cfg

    cfg, _ = model_cfg(name, block)
    if name == "swa":
        cfg.attention.swa.window = 12
    model = build_model(cfg, seed=0)
    lengths = (13, 5, 17)
    T = sum(lengths)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32))
    tokens = jax.random.randint(jax.random.key(5), (1, T), 0, V - 1)
    full = nnx.jit(lambda m, g: m(tokens, None, positions=pos, segment_ids=g)[0])
    step = nnx.jit(lambda m, t, s, p, g: m(t, s, positions=p, segment_ids=g)[:2])
    for first_id in (0, 1):
        seg = jnp.asarray(np.repeat(first_id + np.arange(3), lengths)[None].astype(np.int32))
        state, outs = model.init_state(1, T), []
        for t in range(T):
            out, state = step(model, tokens[:, t:t + 1], state, pos[:, t:t + 1], seg[:, t:t + 1])
            outs.append(out)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full(model, seg)), atol=2e-5,
                                   rtol=2e-5, err_msg=f"ids from {first_id}")
