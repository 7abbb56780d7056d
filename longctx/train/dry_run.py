"""Memory and FLOPs plan of a training run before any data is touched (``longctx-train --dry_run``).

The train step the trainer runs (a decoder's, with the segment ids and positions of packed rows
(``data.packing='segments'``) and a generated task's answer weights where its task's batch carries them; or an
encoder's masked-LM step, its vocabulary and mask token resolved as the training task resolves them) is lowered
and compiled ahead of time for the configured mesh with abstract inputs (``jax.ShapeDtypeStruct`` carrying the
shardings of ``longctx.train.sharding.Plan``); XLA's ``memory_analysis`` gives the per-device bytes of arguments,
temporaries and outputs, and ``cost_analysis`` the FLOPs of one step. The model is built abstractly
(``nnx.eval_shape``), so even a model that does not fit on the host can be planned.
"""

from __future__ import annotations

import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from longctx import config as config_lib
from longctx.bench.common import jaxpr_matmul_flops
from longctx.data import bpe, masking, sources, spm, tokenizers
from longctx.data.dsutil import option
from longctx.data.prepare import prepared_manifest
from longctx.errors import ConfigError
from longctx.models.backbone import scans_layers
from longctx.models.decoder import build_model
from longctx.models.precision import resolve_dtype
from longctx.train import sequence_parallel, sharding, tasks
from longctx.train.optim import make_optimizer
from longctx.train.step import (
    make_loss_fn,
    make_mlm_loss_fn,
    make_mlm_train_step,
    make_packed_loss_fn,
    make_train_step,
    split_model,
)

MiB = 1 << 20


PLAN_REMEDY = "set --config.model.vocab_size for --dry_run to plan without reading data"


def known_vocab(cfg, remedy: str = PLAN_REMEDY) -> tuple[int, int | None]:
    """(the tokenizer's vocabulary size, its own mask token or None) without reading data, as the training task
    resolves the vocabulary (``longctx.train.tasks.Task``): a tokenizer file (``data.tokenizer='hf'``, an imported
    model's) is read, whose ``<mask>`` / ``[MASK]`` an encoder takes (:func:`longctx.data.masking.own_mask_id`);
    otherwise :func:`known_vocab_size`."""
    if cfg.data.tokenizer == "hf":
        tok = tokenizers.build("hf", **tokenizers.cache_kwargs("hf", cfg.data))
        return int(tok.vocab_size), masking.own_mask_id(tok)
    return known_vocab_size(cfg, remedy), None


def known_vocab_size(cfg, remedy: str = PLAN_REMEDY) -> int:
    """The vocabulary size without reading data: from the config, or fixed by the tokenizer; a tokenizer that
    learns it from the data raises, ``remedy`` saying what the caller can give instead."""
    if cfg.model.vocab_size > 0:
        return int(cfg.model.vocab_size)
    if cfg.data.tokenizer == "bytes":
        return 256
    if cfg.data.tokenizer == "sentencepiece":
        return int(option(cfg.data, "vocab_size", 0) or spm.DEFAULT_VOCAB)  # as the sources train it
    if cfg.data.tokenizer == "bpe":  # its ids: data.options.vocab_size whatever the corpus (longctx.data.bpe)
        return int(bpe.settings(cfg.data)["vocab_size"])
    raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} learns its vocabulary from the data and "
                      f"model.vocab_size is 0: {remedy}")


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def training_flops_per_token(cfg, graphdef, params, nongrad, rest) -> dict:
    """Training matmul FLOPs per token: 3 x the forward matmul FLOPs of the loss on one row, counted in its
    jaxpr (``longctx.bench.common.jaxpr_matmul_flops``: a scan body -- stacked layers -- times its length),
    divided by the row's tokens. With windows carrying state, one window with the carried state is traced
    and the count scaled by the windows per row (as ``longctx.bench.step_bench.forward_matmul_flops``).
    Works on abstract parameters (``nnx.eval_shape``): nothing is computed or allocated."""

    tc = cfg.train
    W = tc.window or tc.seq_len
    n_windows = tc.seq_len // W
    if cfg.model.kind == "encoder":  # one row, its masked tokens
        mlm_loss = make_mlm_loss_fn(graphdef, masking.num_masked(tc.seq_len, cfg.mlm.rate))
        res = jaxpr_matmul_flops(lambda p, n, r, b: mlm_loss(p, n, r, b, None, jax.random.key(0))[0],
                                 params, nongrad, rest, mlm_batch(cfg, 1))
        return {"training_flops_per_token": 3.0 * res["flops"] / tc.seq_len, "forward_flops_per_row": res["flops"],
                "flops_count_while_loops": res["while_loops"], "flops_count_opaque": res["opaque"]}
    toks = jax.ShapeDtypeStruct((1, W), np.int32)
    state = (jax.eval_shape(lambda p, n, r: nnx.merge(graphdef, p, n, r).init_state(1, tc.seq_len),
                            params, nongrad, rest) if n_windows > 1 else None)
    if packed(cfg):  # the packed loss the step runs: a method may lay the documents out again on its block grid
        packed_loss = make_packed_loss_fn(graphdef)
        res = jaxpr_matmul_flops(lambda p, n, r, s, t, w: packed_loss(p, n, r, t, t, t, t, w, s, jax.random.key(0))[0],
                                 params, nongrad, rest, state, toks, jax.ShapeDtypeStruct((1, W), np.float32))
    else:
        loss = make_loss_fn(graphdef)
        res = jaxpr_matmul_flops(lambda p, n, r, s, t: loss(p, n, r, t, t, s, jax.random.key(0))[0],
                                 params, nongrad, rest, state, toks)
    fwd_row = res["flops"] * n_windows
    return {"training_flops_per_token": 3.0 * fwd_row / tc.seq_len, "forward_flops_per_row": fwd_row,
            "flops_count_while_loops": res["while_loops"], "flops_count_opaque": res["opaque"]}


def mlm_batch(cfg, batch_size: int, sharding=None) -> dict:
    """An encoder's abstract batch (``longctx.train.step.make_mlm_train_step``): inputs, targets and the mask
    [B, T], with the segment ids and positions of packed rows (``data.packing='segments'``)."""
    def rows(dtype):
        return jax.ShapeDtypeStruct((batch_size, cfg.train.seq_len), dtype, sharding=sharding)

    batch = {"inputs": rows(np.int32), "targets": rows(np.int32), "mask": rows(np.bool_)}
    if packed(cfg):
        batch.update(segment_ids=rows(np.int32), positions=rows(np.int32))
    return batch


def lm_batch(cfg, batch_size: int, sharding=None):
    """A decoder's abstract batch, as its training task (``longctx.train.tasks.LanguageModel`` / ``Recall``)
    gives it to ``longctx.train.step.make_train_step``: the tokens [B, T + 1]; a dict with the answer weights
    [B, T] (a generated task, ``weighted``) and the segment ids and positions [B, T + 1] (``data.packing='segments'``)
    where the task's rows carry them."""
    T = cfg.train.seq_len

    def rows(n, dtype=np.int32):
        return jax.ShapeDtypeStruct((batch_size, n), dtype, sharding=sharding)

    if not (lm_weighted(cfg) or packed(cfg)):
        return rows(T + 1)
    batch = {"tokens": rows(T + 1)}
    if lm_weighted(cfg):
        batch["weights"] = rows(T, np.float32)
    if packed(cfg):
        batch.update(segment_ids=rows(T + 1), positions=rows(T + 1))
    return batch


def plan_packing(cfg) -> tuple[ml_collections.ConfigDict, str]:
    """``cfg`` with ``data.packing='auto'`` resolved as the training task will resolve it
    (``config.resolve_packing``), and the line saying so: where 'auto' would pack a prepared corpus, the train
    split's documents are read from the cache when it is prepared (``prepare.prepared_manifest``: a split of one
    document trains unpacked rows); where it is not prepared yet, the plan is for a corpus of several documents and
    the line says that the run decides once the data is prepared."""
    if cfg.data.packing != "auto" or config_lib.packing_rule(cfg)[0] != "segments" or \
            sources.is_generated(cfg.data.source):
        return config_lib.resolve_packing(cfg, None)
    manifest = prepared_manifest(cfg.data)
    num_docs = manifest["num_docs"] if manifest is not None else None
    cfg, line = config_lib.resolve_packing(cfg, num_docs)
    if num_docs is None:
        line += " (the data is not prepared yet: planned for several documents; a train split of one document " \
                "trains unpacked rows)"
    return cfg, line


def packed(cfg) -> bool:
    """Whether the training rows carry document boundaries (``longctx.train.tasks.LanguageModel.packed``):
    ``data.packing`` as :func:`plan_packing` resolved it."""
    return config_lib.packing_rule(cfg)[0] == "segments"


def lm_weighted(cfg) -> bool:
    """Whether the decoder's task weights its targets (a generated recall task: the answer tokens)."""
    return bool(getattr(tasks.task_class(cfg), "weighted", False))


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` (abstract arrays) laid out by ``shardings``: each leaf's shard shape."""
    return sum(int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def sharding_summary(params, shardings) -> list[dict]:
    """The parameters grouped by partition spec: [{"spec", "tensors", "bytes" (whole), "example"}], largest first."""
    groups: dict[str, dict] = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), s in zip(flat, jax.tree.leaves(shardings)):
        spec = str(tuple(s.spec))
        g = groups.setdefault(spec, {"spec": spec, "tensors": 0, "bytes": 0, "example": ""})
        g["tensors"] += 1
        g["bytes"] += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        if not g["example"]:
            name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
            g["example"] = f"{name} {list(x.shape)}"
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def plan(cfg: ml_collections.ConfigDict, devices=None) -> dict:
    """Compile one train step for ``cfg``'s mesh; return per-device memory (bytes) and FLOPs."""
    cfg = config_lib.validate(cfg)
    vocab_size, mask_token = known_vocab(cfg)
    cfg = config_lib.resolve_vocab(cfg, vocab_size, mask_token=mask_token)
    cfg, packing_line = plan_packing(cfg)
    tc = cfg.train
    mesh = sharding.make_mesh(cfg.mesh, devices)
    abstract_model = nnx.eval_shape(lambda: build_model(cfg.model, seed=tc.seed, execution=cfg.execution))
    graphdef, params, nongrad, rest = split_model(abstract_model)
    tx = make_optimizer(tc)
    opt_state = jax.eval_shape(tx.init, params)
    p = sharding.Plan(mesh, params, nongrad, rest, tx, opt_state, sharding.parse_rules(cfg.mesh.rules))
    if cfg.model.kind == "encoder":  # the masked-LM step, as longctx.train.tasks.MaskedLM compiles it
        split = mesh.shape.get("sequence", 1) > 1
        step = p.jit_step(make_mlm_train_step(graphdef, tx, num_masked=masking.num_masked(tc.seq_len, cfg.mlm.rate),
                                              skip_nonfinite=True, constrain=p.constrain,
                                              row_mesh=mesh if split else None))
        batch = mlm_batch(cfg, tc.batch_size, p.batch)
    else:
        # the step longctx.train.tasks.LanguageModel.make_step compiles: packed rows, answer weights as the task's
        seq_mode, seq_hidden = sequence_parallel.train_hidden(abstract_model, mesh, window=tc.window,
                                                              seq_len=tc.seq_len, mode=cfg.mesh.sequence_mode,
                                                              packed=packed(cfg))
        step = p.jit_step(make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=True,
                                          constrain=p.constrain, weighted=lm_weighted(cfg), hidden=seq_hidden,
                                          microbatches=tc.microbatches, packed=packed(cfg)))
        batch = lm_batch(cfg, tc.batch_size, p.batch)
    args = (
        _abstract(params, p.params), _abstract(nongrad, p.nongrad), _abstract(rest, p.rest),
        _abstract(opt_state, p.opt_state), batch,
        jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=p.scalar),
    )
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    out = {
        "devices": int(np.prod(list(mesh.shape.values()))),
        "mesh": dict(mesh.shape),
        "parameters": n_params,
        "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0)),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
        "output_bytes": int(getattr(mem, "output_size_in_bytes", 0)),
        "alias_bytes": int(getattr(mem, "alias_size_in_bytes", 0)),
        "generated_code_bytes": int(getattr(mem, "generated_code_size_in_bytes", 0)),
        "flops_per_step": float(cost.get("flops", 0.0)),
        "tokens_per_step": tc.batch_size * tc.seq_len,
        # windows carrying state are one optimizer update each (longctx.train.step.make_train_step)
        "tokens_per_update": tc.batch_size * (tc.window or tc.seq_len),
        "compile_s": compile_s,
        # what the arguments hold, per device, from the shardings the step is compiled with
        "param_bytes": per_device_bytes(params, p.params),
        "opt_state_bytes": per_device_bytes(opt_state, p.opt_state),
        "nongrad_bytes": per_device_bytes(nongrad, p.nongrad),
        "param_dtype": str(jax.tree.leaves(params)[0].dtype) if jax.tree.leaves(params) else "",
        "compute_dtype": str(np.dtype(resolve_dtype(cfg.model.dtype))),
        "sharding": sharding_summary(params, p.params),
    }
    out.update(training_flops_per_token(cfg, graphdef, params, nongrad, rest))
    # XLA's cost analysis counts the body of a loop once: scanned layers and micro-batches run it many times
    out["flops_loop_note"] = ("scanned layers / micro-batches: XLA counts a loop body once, so the FLOPs understate "
                              "the step") if (scans_layers(cfg.model) or tc.microbatches > 1) else ""
    out["scan_layers"] = cfg.model.scan_layers  # as validate resolved it
    out["packed"] = packed(cfg)  # the step takes the rows' segment ids and positions
    out["packing_line"] = packing_line  # data.packing='auto': which rule, and why
    out["exact_notes"] = config_lib.exact_attention_notes(cfg)  # a method computing exactly at the row length
    out["vocab_size"] = int(cfg.model.vocab_size)  # as the training task resolves it (resolve_vocab)
    if cfg.model.kind == "encoder":
        out["mask_id"] = int(cfg.mlm.mask_id)
    # donated inputs are reused for the outputs: peak ~ arguments + temporaries (+ outputs not aliased)
    out["peak_bytes_estimate"] = out["argument_bytes"] + out["temp_bytes"] + max(
        0, out["output_bytes"] - out["alias_bytes"])
    return out


def report(res: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in res["mesh"].items())
    shards = [f"  {g['spec']:<24} {g['tensors']:4d} tensors {g['bytes'] / MiB:12.1f} MiB in all  (e.g. {g['example']})"
              for g in res.get("sharding", ())]
    return "\n".join([
        f"dry run: {res['parameters']:,} parameters on {res['devices']} device(s), mesh {mesh}",
        *([res["packing_line"]] if res.get("packing_line") else []),
        *res.get("exact_notes", ()),
        *(["rows: packed documents (the step takes their segment ids and positions)"] if res.get("packed") else []),
        *([f"layers: {'scanned' if res['scan_layers'] == 'on' else 'unrolled'} (model.scan_layers="
           f"{res['scan_layers']!r} as validated for this platform)"] if "scan_layers" in res else []),
        "per device (XLA memory analysis of the compiled train step):",
        f"  arguments    {res['argument_bytes'] / MiB:10.1f} MiB  (parameters, optimizer, non-grad state, batch)",
        f"    parameters ({res.get('param_dtype', '?')}) {res.get('param_bytes', 0) / MiB:.1f} MiB, optimizer state "
        f"{res.get('opt_state_bytes', 0) / MiB:.1f} MiB, non-gradient state {res.get('nongrad_bytes', 0) / MiB:.1f} MiB",
        f"  temporaries  {res['temp_bytes'] / MiB:10.1f} MiB  (activations, gradients and workspace of the step; "
        f"compute dtype {res.get('compute_dtype', '?')})",
        f"  outputs      {res['output_bytes'] / MiB:10.1f} MiB  ({res['alias_bytes'] / MiB:.1f} MiB aliased to "
        "donated inputs)",
        f"  peak (est.)  {res['peak_bytes_estimate'] / MiB:10.1f} MiB  ({res['peak_bytes_estimate'] / (1 << 30):.2f} GiB)",
        *(["parameter sharding (partition spec over the mesh axes):", *shards] if shards else []),
        f"FLOPs per step per device: {res['flops_per_step']:.3e} "
        f"({res['tokens_per_step']:,} tokens per step, whole batch)"
        + (f"; {res['flops_loop_note']}" if res.get("flops_loop_note") else ""),
        f"tokens per update: {res['tokens_per_update']:,} (batch x window); compile {res['compile_s']:.1f} s",
        f"training FLOPs per token (3 x forward matmuls): {res['training_flops_per_token']:.4e}"
        + (" (a lower bound: loops of unknown trip count counted once)" if res.get("flops_count_while_loops") else "")
        + (f" (not counted: {', '.join(res['flops_count_opaque'])})" if res.get("flops_count_opaque") else ""),
    ])
