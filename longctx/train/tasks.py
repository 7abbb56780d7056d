"""What the training loop trains: a task makes the batches, the train step and the evaluation.

The loop (:mod:`longctx.train.loop`) picks the task once from the config (:func:`from_config`) and
then only calls this interface::
    task = from_config(cfg, progress=...)     # reads (or generates) its data; task.cfg: vocabulary resolved
    task.setup(model, graphdef, tx, plan)     # batchers, task.train_step, the evaluation forward
    task.summary()                            # the data line the loop prints at the start
    task.batch(step)                          # the device batch of the step starting at ``step``
    task.train_step(params, nongrad, rest, opt_state, batch, key) -> (params, nongrad, opt_state, metrics)
    task.evaluate((params, nongrad, rest))    # the scoring protocol's result
    task.valid_record(result)                 # what the loop logs as the 'valid' record
    task.checkpoint_extra()                   # what every checkpoint records besides the state

The tasks:

* :class:`LanguageModel`: a decoder on a prepared corpus; rows of ``seq_len + 1`` tokens, next-token
  loss in windows of ``train.window``, validation by :func:`longctx.protocols.score_split`. With
  ``data.packing='segments'`` the rows carry their documents' segment ids and positions, and the step
  attends within each document (``make_train_step(packed=True)``).
* :class:`MaskedLM`: an encoder (``model.kind='encoder'``); rows of ``seq_len`` tokens masked as a
  function of (seed, step, row), loss on the masked tokens, validation by
  :func:`longctx.protocols.score_mlm_split` (loss and accuracy).
* :class:`AttentionTransfer` (``train.task='attention_transfer'``): the rows of :class:`LanguageModel`; the
  loss is each swapped layer's distance to exact attention on the same q, k, v, and only those layers' cores'
  own parameters train; validation as :class:`LanguageModel`.
* :class:`Recall`: a decoder on a generated recall task (``data.source`` generated, see
  :mod:`longctx.data.synthetic`); rows made on the fly (with ``data.packing='segments'``, several examples a row,
  each attended alone), loss on the answer tokens, validation on the task's fixed evaluation rows (single
  examples) by :func:`longctx.protocols.score_answers` (answer loss and exact match).
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from flax import nnx

from longctx import attention
from longctx import config as config_lib
from longctx.data import masking, sources, tokenizers
from longctx.data.batching import Batcher
from longctx.data.prepare import prepare
from longctx.data.synthetic import RowBatcher
from longctx.errors import ConfigError
from longctx.models.blocks import layer_methods
from longctx.models.decoder import with_execution
from longctx.protocols import check_state, score_answers, score_mlm_split, score_split, split_jobs
from longctx.train import sequence_parallel, sharding
from longctx.train.optim import core_mask
from longctx.train.step import (
    jit_forward,
    make_forward,
    make_mlm_forward,
    make_mlm_train_step,
    make_scored_forward,
    make_train_step,
    make_transfer_loss_fn,
)


class Task:
    """The shared part: a prepared corpus (train and ``eval.split``), a batcher per row length, and
    the staged-training choice of batcher (``train.short_steps``)."""

    name = ""
    #: the 'valid' record: (its key, the key in the scoring protocol's result), in logging order
    valid_metrics = (("loss", "loss_nats_per_token"), ("bits_per_token", "bits_per_token"))

    def __init__(self, cfg: ml_collections.ConfigDict, *, progress: bool = False):
        self.tokenizer, self.splits, self.data_dir = self.load(cfg, progress=progress)
        cfg = config_lib.resolve_vocab(cfg, self.tokenizer.vocab_size, mask_token=masking.own_mask_id(self.tokenizer))
        # data.packing='auto': the rule this corpus and model train with (config.packing_rule), said at the start
        self.cfg, self.packing_line = config_lib.resolve_packing(
            cfg, self.splits["train"].num_docs if self.splits else None)

    # ---- data
    def load(self, cfg, *, progress: bool):
        """(tokenizer, {split: TokenData} or None, the prepared data's folder or None)."""
        return prepare(cfg.data, ["train", cfg.eval.split], progress=progress)

    def make_batcher(self, seq_len: int, host: tuple[int, int]):
        tc = self.cfg.train
        return Batcher(self.splits["train"], row_len=seq_len + 1, batch_size=tc.batch_size, seed=tc.seed,
                       shard=host, packing=self.cfg.data.packing)

    def summary(self) -> str:
        return "; ".join(x for x in (self.packing_line, self.batcher.summary()) if x)

    def checkpoint_extra(self) -> dict:
        return {"data_dir": str(self.data_dir) if self.data_dir is not None else ""}

    # ---- step
    def setup(self, model, graphdef, tx, plan: sharding.Plan) -> None:
        """The batchers (this host's rows), ``self.train_step`` and the evaluation forward. A 'stop' on
        non-finite values also runs the skipping step: a non-finite update is not applied, so the state
        at the stop is the last finite one and can be checkpointed."""
        tc = self.cfg.train
        self.graphdef, self.mesh = graphdef, plan.mesh
        host = sharding.host_shard(plan.mesh, tc.batch_size)  # the rows of every batch this process reads
        self.batcher = self.make_batcher(tc.seq_len, host)
        # staged training (train.short_steps): the first updates see rows of train.short_seq_len tokens
        self.short_batcher = self.make_batcher(tc.short_seq_len, host) if tc.short_steps > 0 else None
        self.train_step, self.forward = self.make_step(model, graphdef, tx, plan)

    def make_step(self, model, graphdef, tx, plan):
        """(the jitted train step, the jitted evaluation forward)."""
        raise NotImplementedError

    def host_batch(self, at_step: int) -> dict:
        """The host rows of the step starting at ``at_step``."""
        batcher = self.short_batcher if at_step < self.cfg.train.short_steps else self.batcher
        return batcher.batch(config_lib.batch_index(self.cfg, at_step))

    def windows_at(self, at_step: int) -> int:
        """The updates of the train step starting at ``at_step`` (its row's windows)."""
        return config_lib.windows_at(self.cfg, at_step)

    def batch(self, at_step: int):
        """The batch of the step starting at ``at_step``, read on the host and sent to the devices."""
        raise NotImplementedError

    # ---- evaluation
    def init_state(self, state):
        return lambda b, n: nnx.merge(self.graphdef, *state).init_state(b, n)

    def eval_config(self) -> ml_collections.ConfigDict:
        """``eval`` with the periodic validation's token budget (``train.eval_tokens``)."""
        cfg, tc = self.cfg, self.cfg.train
        ecfg = ml_collections.ConfigDict(cfg.eval.to_dict())
        ecfg.max_tokens = tc.eval_tokens if cfg.eval.max_tokens == 0 else min(cfg.eval.max_tokens, tc.eval_tokens)
        return ecfg

    def one_token_per_byte(self) -> bool:
        return bool(getattr(self.tokenizer, "one_token_per_byte", False))

    def evaluate(self, state, stop=None) -> dict:
        """Score ``state`` = (params, nongrad, rest) on the validation data; the protocol's result. ``stop``: a
        callable checked between forward calls (``protocols.EvaluationStopped`` once it is true)."""
        raise NotImplementedError

    def check_evaluation(self, state) -> None:
        """Refuse in one line, before the first step, a validation the model cannot run (a state that cannot hold
        the protocol's longest stream); nothing to check by default."""

    def valid_record(self, res: dict) -> dict:
        """The validation metrics logged, with bits per byte where the tokenizer keeps bytes (bytes, bpe)."""
        out = {key: res[field] for key, field in self.valid_metrics}
        if "bits_per_byte" in res:
            out["bits_per_byte"] = res["bits_per_byte"]
        return out


class LanguageModel(Task):
    """A decoder on a prepared corpus: next-token loss, windows carrying the state."""

    name = "language_model"
    weighted = False  # the loss weights come with the batch (generated tasks: the answer tokens)

    def make_step(self, model, graphdef, tx, plan):
        tc, mesh = self.cfg.train, plan.mesh
        windows = (tc.window,) + ((tc.short_seq_len,) if config_lib.short_windows(tc) == 1 else ())
        seq_mode, seq_hidden = sequence_parallel.train_hidden(model, mesh, window=windows, seq_len=tc.seq_len,
                                                              mode=self.cfg.mesh.sequence_mode, packed=self.packed())
        if mesh.shape["sequence"] > 1:
            why = sequence_parallel.train_decision(model, mesh, windows, self.cfg.mesh.sequence_mode,
                                                   packed=self.packed())[1]
            print(f"sequence parallelism over {mesh.shape['sequence']} devices: {seq_mode} ({why})")
        step = plan.jit_step(make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=True,
                                             constrain=plan.constrain, weighted=self.weighted, hidden=seq_hidden,
                                             microbatches=tc.microbatches, packed=self.packed()))
        return step, jit_forward(self.make_forward(graphdef))

    def make_forward(self, graphdef):
        return make_forward(graphdef)

    def packed(self) -> bool:
        """Whether the rows carry document boundaries (``data.packing='segments'``)."""
        return self.cfg.data.packing == "segments"

    def batch(self, at_step):
        batch = self.host_batch(at_step)
        if self.packed():
            return {k: sharding.shard_batch(self.mesh, batch[k]) for k in ("tokens", "segment_ids", "positions")}
        return sharding.shard_batch(self.mesh, batch["tokens"])

    def check_evaluation(self, state):
        ecfg = self.eval_config()
        jobs, window = split_jobs(self.splits[self.cfg.eval.split], ecfg, tokenizer=self.tokenizer,
                                  one_token_per_byte=self.one_token_per_byte())[3:5]
        check_state(self.init_state(state), jobs, window=window, batch_size=ecfg.batch_size, ecfg=ecfg)

    def evaluate(self, state, stop=None):
        fwd = self.forward
        res, _ = score_split(
            lambda p, inputs, targets, st: fwd(*p, inputs, targets, st), state, self.splits[self.cfg.eval.split],
            self.eval_config(), init_state=self.init_state(state), one_token_per_byte=self.one_token_per_byte(),
            tokenizer=self.tokenizer, progress=False, stop=stop,
        )
        return res


class MaskedLM(Task):
    """An encoder on a prepared corpus: the masks of a row are a function of (seed, step, row), the
    loss is on the masked tokens."""

    name = "masked_lm"
    valid_metrics = Task.valid_metrics + (("accuracy", "accuracy"),)

    def make_batcher(self, seq_len, host):
        tc = self.cfg.train
        return Batcher(self.splits["train"], row_len=seq_len, batch_size=tc.batch_size, seed=tc.seed, shard=host,
                       packing=self.cfg.data.packing)

    def make_step(self, model, graphdef, tx, plan):
        cfg, tc = self.cfg, self.cfg.train
        n_mask = masking.num_masked(tc.seq_len, cfg.mlm.rate)
        split = plan.mesh.shape.get("sequence", 1) > 1  # rows split over the mesh: a fused kernel needs to know
        step = plan.jit_step(make_mlm_train_step(graphdef, tx, num_masked=n_mask, skip_nonfinite=True,
                                                 constrain=plan.constrain, row_mesh=plan.mesh if split else None))
        self.row0 = self.batcher.shard_index * tc.batch_size // self.batcher.num_shards  # this host's first global row
        return step, jax.jit(make_mlm_forward(graphdef, masking.num_masked(cfg.eval.context, cfg.mlm.rate)))

    def batch(self, at_step):
        host = self.host_batch(at_step)
        tokens = host["tokens"]
        rows = self.row0 + np.arange(len(tokens))
        mlm = self.cfg.mlm
        corrupted = masking.with_boundaries(masking.mask_rows(tokens, mlm, seed=self.cfg.train.seed, step=at_step,
                                                              rows=rows, mask_id=mlm.mask_id,
                                                              **masking.replacement_vocab(self.tokenizer)), host)
        return {k: sharding.shard_batch(self.mesh, v) for k, v in corrupted.items()}

    def evaluate(self, state, stop=None):
        cfg, fwd = self.cfg, self.forward
        res, _ = score_mlm_split(
            lambda p, inputs, targets, mask: fwd(*p, inputs, targets, mask), state, self.splits[cfg.eval.split],
            self.eval_config(), cfg.mlm, context=cfg.eval.context, mask_id=cfg.mlm.mask_id,
            replacement=masking.replacement_vocab(self.tokenizer), one_token_per_byte=self.one_token_per_byte(),
            progress=False, stop=stop,
        )
        return res


class Recall(LanguageModel):
    """A generated recall task: rows made on the fly as a function of (seed, step, row), loss on the
    answer tokens; validated on the task's fixed evaluation rows (answer loss and exact match)."""

    name = "recall"
    weighted = True
    valid_metrics = Task.valid_metrics + (("accuracy", "accuracy"),)

    def load(self, cfg, *, progress):
        self.source = sources.build(cfg.data)
        self.eval_set = None  # made on the first evaluation
        return tokenizers.build(cfg.data.tokenizer), None, None

    def make_batcher(self, seq_len, host):
        tc = self.cfg.train
        return RowBatcher(self.source, row_len=seq_len, batch_size=tc.batch_size, seed=tc.seed, shard=host)

    def make_forward(self, graphdef):
        return make_scored_forward(graphdef)

    def summary(self):
        packed = (f", packed: examples of at least {self.source.example_len} inputs back to back, each attended "
                  "alone" if self.packed() else "")
        line = (f"{self.cfg.data.source} rows generated on the fly ({self.source.options()}){packed}, "
                "loss on the answer tokens")
        return "; ".join(x for x in (self.packing_line, line) if x)

    def batch(self, at_step):
        batch = self.host_batch(at_step)
        keys = ("tokens", "weights") + (("segment_ids", "positions") if self.packed() else ())
        return {k: sharding.shard_batch(self.mesh, batch[k]) for k in keys}

    def check_evaluation(self, state):
        """Its validation rows are as long as its training rows."""

    def evaluate(self, state, stop=None):
        cfg, fwd = self.cfg, self.forward
        syn = cfg.data.synthetic
        if self.eval_set is None:
            self.eval_set = self.source.eval_rows(row_len=self.source.example_len or cfg.train.seq_len,
                                                  n_rows=syn.eval_rows, bins=syn.bins,
                                                  split=cfg.eval.split, seed=syn.eval_seed)
        return score_answers(
            lambda p, inputs, targets, st: fwd(*p, inputs, targets, st), state, *self.eval_set,
            window=cfg.eval.window, batch_size=cfg.eval.batch_size, init_state=self.init_state(state), progress=False,
            stop=stop,
        )


class AttentionTransfer(LanguageModel):
    """Attention transfer (``train.task='attention_transfer'``): the rows of a language model, and a step whose
    loss is, for each swapped layer (a layer whose method is not the exact one), the mean squared error between
    its core's output and the exact method's output on the same q, k, v in the same forward (the exact branch
    under ``stop_gradient``; the exact output is what the layers above see, :class:`longctx.train.step.
    TransferProbe`). Only the swapped layers' cores' own parameters are updated (the rest is frozen:
    :func:`longctx.train.step._frozen`); the train record's ``loss`` is the summed transfer MSE and
    ``layer{i}/transfer_mse`` each layer's. Validation scores the swapped model's LM loss as
    :class:`LanguageModel` does. The configuration rules (a decoder, whole rows, no packing, one device per row,
    unrolled transformer blocks, a layer to transfer) are in :mod:`longctx.config`; a run whose swapped layers'
    methods have no parameters of their own is refused here, in one line."""

    name = "attention_transfer"

    def make_step(self, model, graphdef, tx, plan):
        cfg, tc = self.cfg, self.cfg.train
        methods = layer_methods(cfg.model)
        layers = [i for i, m in enumerate(methods) if not attention.get_class(m).exact]
        own = {i: len(jax.tree.leaves(nnx.state(model.blocks[i].core, nnx.Param))) for i in layers}
        if not any(own.values()):
            names = sorted({methods[i] for i in layers})
            raise ConfigError(f"train.task='attention_transfer': {', '.join(names)} has no trainable parameters of "
                              "its own in the swapped layers, so there is nothing to transfer; fine-tune instead "
                              "(train.task='auto')")
        for i in (i for i in layers if not own[i]):
            print(f"attention transfer: layer {i} ({methods[i]}) has no parameters of its own; its transfer loss is "
                  "logged and nothing there trains")
        self.layers = tuple(layers)
        exact = next(n for n in attention.names() if attention.get_class(n).exact)
        exact_cfg = with_execution(cfg.model, cfg.get("execution")).attention.get(exact)

        def exact_core(core):
            return attention.build(exact, exact_cfg, num_heads=core.num_heads, head_dim=core.head_dim,
                                   value_dim=core.value_dim, causal=core.causal, rngs=nnx.Rngs(0))

        loss = make_transfer_loss_fn(graphdef, self.layers, exact_core, constrain=plan.constrain)
        trainable = core_mask(nnx.state(model, nnx.Param), self.layers)
        step = plan.jit_step(make_train_step(graphdef, tx, seq_len=tc.seq_len, window=tc.window, skip_nonfinite=True,
                                             constrain=plan.constrain, microbatches=tc.microbatches, loss=loss,
                                             trainable=trainable))
        return step, jit_forward(self.make_forward(graphdef))

    def summary(self):
        return (f"{super().summary()}; attention transfer in layer(s) {', '.join(map(str, self.layers))} "
                "(only their cores' own parameters train)")


def task_class(cfg: ml_collections.ConfigDict) -> type[Task]:
    """The task a (validated) config trains."""
    if cfg.train.task == "attention_transfer":
        return AttentionTransfer
    if sources.is_generated(cfg.data.source):
        return Recall
    return MaskedLM if cfg.model.kind == "encoder" else LanguageModel


def from_config(cfg: ml_collections.ConfigDict, *, progress: bool = False) -> Task:
    """The task of a validated ``cfg``, its data read or its generator built; ``task.cfg`` is ``cfg``
    with the vocabulary resolved from the task's tokenizer (:func:`longctx.config.resolve_vocab`)."""
    return task_class(cfg)(cfg, progress=progress)
