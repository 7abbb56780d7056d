"""Every shipped config's training step lowers for the accelerators from this CPU host (``jax.export``, nothing
compiled): the step ``longctx-train`` runs (packed rows, answer weights, windows, the masked-LM step of an encoder),
its model built for the platform (``scan_layers`` and the compute dtype resolved there, each attention core's
implementations chosen there), at the config's own shapes. cuda at compute capability 9.0 (Hopper: no Triton
kernel, the Mosaic GPU ones where they serve) and 8.0 (Triton), and tpu. A lowering failure here is one the
first run on a lent GPU would have hit before its first step (such as the Mosaic GPU layout failure of EVA's
packed rows). The full-size variants and the other platforms are slow; the main job's config is in the default
run. The pretrained configs need their checkpoints and are left out."""

from __future__ import annotations

import re
import warnings

import jax
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx import config_files
from longctx.attention import dispatch
from longctx.attention.base import capacity_guaranteed_by_caller
from longctx.data import masking
from longctx.models.decoder import build_model
from longctx.train import dry_run
from longctx.train.optim import make_optimizer
from longctx.train.step import make_mlm_train_step, make_train_step, split_model

# custom calls without jax.export's compatibility guarantee (lowered here, never serialized)
UNGUARANTEED = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaSoftmaxDropout",
                "__cudnn$fmhaSoftmaxDropoutBackward", "__gpu$xla.gpu.triton")
WIKITEXT_VOCAB = 267_735  # the words tokenizer learns it from the data; its configs' adaptive cutoffs lie below


def _configs(tiny: bool):
    out = []
    for path, variants in config_files.shipped():
        if path == "configs/base.py" or path.startswith("configs/pretrained/"):
            continue
        out.append(path + (":tiny" if tiny and "tiny" in variants else ""))
    return out


@pytest.fixture
def from_this_host(monkeypatch):
    """A lowering for another platform from a CPU host: the cuDNN version probe answered (jaxlib here has no cuDNN),
    VCC's VIP-count warnings (a host callback, which lowers only for the host's own platform) off, and the traced
    capacity checks (host callbacks too) off while tracing; ``set_cc(cc)`` answers the compute capability."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    import longctx.attention.vcc.stack as vcc_stack

    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(vcc_stack, "_report_vips", lambda *a, **k: None)

    def set_cc(cc):
        monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: cc)

    return set_cc


def lowered_step(arg: str, platform: str) -> str:
    """The StableHLO text of ``arg``'s training step lowered for ``platform``."""
    cfg = config_files.load(arg)
    if cfg.data.tokenizer == "words" and not cfg.model.vocab_size:
        cfg.model.vocab_size = WIKITEXT_VOCAB
    cfg = config_lib.validate(cfg, platform)
    vocab, mask = dry_run.known_vocab(cfg)
    cfg = config_lib.resolve_vocab(cfg, vocab, mask_token=mask)
    cfg, _ = dry_run.plan_packing(cfg)
    tc = cfg.train
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0, execution=cfg.execution, platform=platform))
    graphdef, params, nongrad, rest = split_model(model)
    tx = make_optimizer(tc)
    opt_state = jax.eval_shape(tx.init, params)
    if cfg.model.kind == "encoder":
        step = make_mlm_train_step(graphdef, tx, num_masked=masking.num_masked(tc.seq_len, cfg.mlm.rate),
                                   skip_nonfinite=True)
        batch = dry_run.mlm_batch(cfg, tc.batch_size)
    else:
        step = make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=True,
                               weighted=dry_run.lm_weighted(cfg), microbatches=tc.microbatches,
                               packed=dry_run.packed(cfg))
        batch = dry_run.lm_batch(cfg, tc.batch_size)
    args = (params, nongrad, rest, opt_state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
    checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in UNGUARANTEED]
    with warnings.catch_warnings(), capacity_guaranteed_by_caller():
        warnings.simplefilter("ignore")
        return jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


def _check(text: str, platform: str, cc: str | None) -> None:
    """The program's custom calls are the platform's: on Hopper no Triton kernel ('auto' takes none there,
    ``dispatch.hopper``), before it no Mosaic GPU one (Hopper-only), on a TPU nothing of a GPU's."""
    targets = set(re.findall(r"custom_call @([\w$.\-]+)", text))
    if platform == "cuda":
        assert not any(("triton" if cc == "9.0" else "mosaic_gpu") in t for t in targets), targets
        assert not any(t.startswith("tpu") for t in targets), targets
    if platform == "tpu":
        assert not any("cudnn" in t or "gpu" in t for t in targets), targets


TARGETS = [("cuda", "9.0"), ("cuda", "8.0"), ("tpu", None)]


@pytest.mark.parametrize("platform,cc", TARGETS)
def test_the_main_jobs_step_lowers_for_every_accelerator(from_this_host, platform, cc):
    from_this_host(cc)
    _check(lowered_step("configs/main.py", platform), platform, cc)


@pytest.mark.slow
@pytest.mark.parametrize("arg", _configs(tiny=False))
def test_every_config_lowers_for_hopper_at_its_own_size(from_this_host, arg):
    from_this_host("9.0")
    _check(lowered_step(arg, "cuda"), "cuda", "9.0")


@pytest.mark.slow
@pytest.mark.parametrize("platform,cc", TARGETS[1:])
@pytest.mark.parametrize("arg", _configs(tiny=True))
def test_every_config_lowers_for_ampere_and_tpu(from_this_host, arg, platform, cc):
    from_this_host(cc)
    _check(lowered_step(arg, platform), platform, cc)
