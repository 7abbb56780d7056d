"""Attention transfer (``train.task='attention_transfer'``) on the imported tiny Llama-style model with EVA swapped
into layer 1: a short run of the task's own train step lowers the layer's transfer loss (EVA's output against exact
attention on the same q, k, v), moves only that layer's core parameters, and leaves a model whose LM loss is below
the untrained swap's. The tokens are sampled from the source (exact) model, so that its predictions are the ones
the data rewards and the swapped layer's distance to exact attention shows in the LM loss."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.errors import ConvertError
from longctx.convert.safetensors import Folder
from longctx.errors import ConfigError
from longctx.train import sharding, tasks
from longctx.train.optim import make_optimizer
from longctx.train.step import make_forward
from tests.convert import hf_tokenizers

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama_tiny"
T, ROWS, STEPS = 48, 8, 30


def _config(pattern=("dense", "eva"), **train):
    c = config_lib.base_config()
    c.model.attention.pattern = pattern
    c.model.attention.eva.window_size = 8  # a window shorter than the rows: the far chunks are EVA's own estimate
    c.model.attention.eva.chunk_size = 4
    c.train.task = "attention_transfer"
    c.train.update(seq_len=T, batch_size=ROWS, steps=STEPS, lr=1e-2, warmup_steps=2, min_lr_ratio=1.0,
                   weight_decay=0.01, **train)
    fam, cfg = core.hf_model_config(core.read_hf_config(FIXTURE), c)
    return fam, cfg


def _sample(graphdef, params, nongrad, rest, vocab, key):
    """[ROWS, T + 1] tokens sampled from the model (temperature 1), each row from its own first token."""
    fwd = jax.jit(lambda toks: nnx.merge(graphdef, params, nongrad, rest).logits(
        nnx.merge(graphdef, params, nongrad, rest).hidden(toks, None, deterministic=True)[0]))
    k0, key = jax.random.split(key)
    toks = jnp.zeros((ROWS, T + 1), jnp.int32).at[:, 0].set(jax.random.randint(k0, (ROWS,), 0, vocab))
    for t in range(T):
        key, kt = jax.random.split(key)
        toks = toks.at[:, t + 1].set(jax.random.categorical(kt, fwd(toks)[:, t].astype(jnp.float32)))
    return toks


def _lm_loss(fwd, state, tokens):
    nll, _ = fwd(*state, tokens[:, :-1], tokens[:, 1:], None)
    return float(jnp.mean(nll))


def test_attention_transfer_lowers_the_layer_loss_and_the_lm_loss():
    fam, cfg = _config()
    cfg = config_lib.validate(cfg)
    graphdef, params, nongrad, rest = core.load_params(fam, cfg, Folder(FIXTURE))
    model = nnx.merge(graphdef, params, nongrad, rest)

    # the data: tokens the source model (every layer exact) samples
    fam0, cfg0 = core.hf_model_config(core.read_hf_config(FIXTURE), config_lib.base_config())
    src = core.load_params(fam0, config_lib.validate(cfg0), Folder(FIXTURE))
    data = [_sample(*src, cfg.model.vocab_size, jax.random.key(i)) for i in range(2)]
    train_rows, held_out = data

    task = tasks.task_class(cfg).__new__(tasks.task_class(cfg))
    assert isinstance(task, tasks.AttentionTransfer)
    task.cfg = cfg
    tx = make_optimizer(cfg.train)
    opt_state = tx.init(params)
    plan = sharding.Plan(sharding.make_mesh(cfg.mesh), params, nongrad, rest, tx, opt_state)
    step, _ = task.make_step(model, graphdef, tx, plan)
    fwd = jax.jit(make_forward(graphdef))

    before = _lm_loss(fwd, (params, nongrad, rest), held_out)
    start = {k: np.array(v.get_value()) for k, v in nnx.to_flat_state(params)}  # the step donates its inputs
    p, ng, o = params, nongrad, opt_state
    losses = []
    for i in range(STEPS):
        p, ng, o, metrics = step(p, ng, rest, o, train_rows, jax.random.key(i))
        assert set(metrics) >= {"layer1/transfer_mse", "ce", "loss"} and "layer0/transfer_mse" not in metrics
        losses.append(float(metrics["layer1/transfer_mse"][0]))
    after = _lm_loss(fwd, (p, ng, rest), held_out)

    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses
    print(f"transfer MSE {losses[0]:.4g} -> {losses[-1]:.4g}; held-out LM loss {before:.4f} -> {after:.4f}")
    assert after < before, (before, after)
    # only layer 1's core moved
    moved = {"/".join(map(str, k)) for k, v in nnx.to_flat_state(p) if not np.array_equal(start[k], v.get_value())}
    assert moved and all(k.startswith("blocks/1/core/") for k in moved), sorted(moved)


def test_attention_transfer_refusals():
    with pytest.raises(ConfigError, match="every layer runs exact attention"):
        config_lib.validate(_config(pattern=("dense", "dense"))[1])
    with pytest.raises(ConfigError, match="train.window=16 < train.seq_len"):
        config_lib.validate(_config(window=16)[1])


def test_extend_positions_copies_the_learned_rows(tmp_path):
    """``--extend_positions=4`` on the RoBERTa fixture: 4x the positions (``train.seq_len`` up to them), RoBERTa's
    offset rows kept, the learned rows copied 4 times (read back through an export); a refusal in one line for
    rotary positions."""
    src = FIXTURE.parent / "roberta_tiny"
    hf = json.loads((src / "config.json").read_text())
    off = hf["pad_token_id"] + 1
    P = hf["max_position_embeddings"] - off
    c = config_lib.base_config()
    c.train.seq_len = 4096
    core.import_hf(hf_tokenizers.with_tokenizer("roberta_tiny", tmp_path / "src"), tmp_path / "run", config=c,
                   extend=4, optimizer_state=False, log=lambda *_: None)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["max_len"] == 4 * P and saved["train"]["seq_len"] == 4 * P
    core.export_hf(tmp_path / "run", tmp_path / "exported", log=lambda *_: None)
    name = next(n for n in Folder(src).names() if n.endswith("position_embeddings.weight"))
    source = np.asarray(Folder(src).get(name))
    table = np.asarray(Folder(tmp_path / "exported").get(
        next(n for n in Folder(tmp_path / "exported").names() if n.endswith("position_embeddings.weight"))))
    assert table.shape == (off + 4 * P, source.shape[1])
    np.testing.assert_array_equal(table[:off], source[:off])
    for r in range(4):
        np.testing.assert_array_equal(table[off + r * P: off + (r + 1) * P], source[off:])
    with pytest.raises(ConvertError, match="copying applies to learned ones"):
        core.import_hf(FIXTURE, tmp_path / "llama", extend=4, dry_run=True, log=lambda *_: None)


def _word_corpus(folder: Path) -> Path:
    """Documents of runs of consecutive fixture words (w2, w3, ...: the tiny tokenizer's vocabulary), something a
    tiny model learns in a few steps."""
    words = [f"w{i}" for i in range(2, 42)]
    rng = np.random.default_rng(0)
    folder.mkdir()
    for d in range(40):
        text = " ".join(" ".join(words[(s + j) % len(words)] for j in range(8)) for s in rng.integers(0, 40, 60))
        (folder / f"doc{d:02d}.txt").write_text(text + "\n")
    return folder


@pytest.mark.slow  # an import, two compiled train steps, two short runs: about 20 s on 2 CPU cores
def test_fine_tuning_after_transfer_resumes_the_run_as_a_language_model(tmp_path):
    """docs/pretrained.md, "Attention transfer": import with EVA in every other layer, the transfer run (its train
    record names the transfer loss ``transfer_mse``, no bits per token), then the same run resumed with
    ``train.task=auto``: ordinary LM training of every parameter from the transfer's checkpoint, the LM loss falls."""
    from longctx.cli import train_main
    from longctx.convert.cli import main as convert

    run, transfer, total = tmp_path / "run", 6, 26
    assert convert(["longctx-convert", "import", f"--hf_dir={FIXTURE}", f"--workdir={run}",
                    "--config=configs/pretrained/llama_to_eva.py:tiny", "--noprogress",
                    f"--config.data.path={_word_corpus(tmp_path / 'corpus')}", f"--config.train.steps={transfer}",
                    "--config.train.log_every=1", f"--config.train.eval_every={transfer}",
                    f"--config.train.ckpt_every={transfer}"]) == 0
    assert train_main(["longctx-train", f"--config={run}/config.py", f"--workdir={run}", "--noprogress"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stage1 = [r for r in records if r["split"] == "train"]
    assert len(stage1) == transfer
    assert all("transfer_mse" in r and "bits_per_token" not in r and "layer1/transfer_mse" in r for r in stage1)
    after_transfer = {k: np.array(v) for k, v in _params(run).items()}

    assert train_main(["longctx-train", f"--config={run}/config.py", f"--workdir={run}", "--noprogress",
                       "--config.train.task=auto", f"--config.train.steps={total}", "--config.train.lr=3e-3",
                       f"--config.train.eval_every={total}", f"--config.train.ckpt_every={total}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stage2 = [r for r in records if r["split"] == "train" and r["step"] > transfer]
    assert len(stage2) == total - transfer
    assert all("bits_per_token" in r and "transfer_mse" not in r for r in stage2)
    losses = np.array([r["loss"] for r in stage2])
    assert np.all(np.isfinite(losses)) and losses[-3:].mean() < losses[:3].mean() - 0.1, losses
    # every parameter trains now, not only the swapped core's
    moved = {k for k, v in _params(run).items() if not np.array_equal(after_transfer[k], v)}
    assert any(k.startswith("blocks/0/") for k in moved) and any("/core/" in k for k in moved), sorted(moved)
    assert "embed" in " ".join(moved), sorted(moved)


def _params(run: Path) -> dict:
    from longctx.runtime import Runner

    params = Runner.from_workdir(run).params[0]
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}
