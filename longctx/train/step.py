"""Pure train and eval step functions over split NNX state.

The model is split once into ``graphdef`` and three states: ``params``
(nnx.Param, trained), ``nongrad`` (NonGradState, e.g. VQ codebook statistics,
updated from ``aux['stats']`` after each optimizer update) and ``rest``
(anything else, carried unchanged).

Windowed training (DESIGN.md section 4): a row of T tokens is processed in T/W
windows, the model state carried under stop-gradient, one optimizer update
(and one non-gradient update) per window.

Gradient accumulation (``microbatches=k > 1``): each update's rows are split into k micro-batches
(rows ``j, j+k, j+2k, ...``, so each is spread over the data-parallel devices like the batch) run
one after another under ``lax.scan``; the update uses the sum of their gradients, each micro-batch's
loss weighted so that the sum is the gradient of the whole batch's loss, and the non-gradient
statistics (codebook EMA sums) are summed over the micro-batches, as they are over the batch.
The carried state of windowed training is split and put back together the same way.

Loss scaling (``train.loss_scale``; dynamic by default for ``model.dtype='float16'``, see
:func:`with_loss_scale`): the optimizer is wrapped so that its state carries the scale (and with it every
checkpoint). Each update differentiates ``scale * loss``, unscales the gradients in float32 and applies them
only if they are finite; a dynamic scale is halved after a non-finite gradient and doubled after
``train.loss_scale_period`` finite updates in a row. Without loss scaling nothing here changes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from longctx.attention import NonGradState, row_split
from pallas_kernels.precision import statistic


def split_model(model):
    return nnx.split(model, nnx.Param, NonGradState, ...)


def token_nll(logits, targets):
    """Per-token negative log-likelihood in nats, [B, T] (fp32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _hidden(model, hidden):
    """``model.hidden``, or ``hidden(model, ...)`` (the sequence-parallel hook of
    ``longctx.train.sequence_parallel.make_hidden``)."""
    return model.hidden if hidden is None else functools.partial(hidden, model)


def make_loss_fn(graphdef, constrain=None, hidden=None):
    def loss_fn(params, nongrad, rest, inputs, targets, state, key):
        if constrain is not None:  # place rows / tokens on the mesh (sharding.constrain_tokens)
            inputs, targets = constrain(inputs), constrain(targets)
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, new_state, aux = _hidden(model, hidden)(inputs, state, deterministic=False, key=key)
        ce = jnp.mean(model.nll(h, targets))
        extra = sum(aux["losses"].values()) if aux["losses"] else 0.0
        return ce + extra, (ce, new_state, aux)

    return loss_fn


def _weighted_ce(model, h, targets, weights):
    """sum(w * nll) / sum(w) over the targets of [B, W] weights ``w`` (0 where nothing is scored)."""
    w = weights.astype(jnp.float32)
    return jnp.sum(model.nll(h, targets) * w) / jnp.maximum(jnp.sum(w), 1e-9)


def make_weighted_loss_fn(graphdef, constrain=None, hidden=None):
    """The LM loss over the scored targets only: sum(w * nll) / sum(w) with per-target weights ``w``
    (a generated source's answer tokens; a window without scored targets contributes 0)."""

    def loss_fn(params, nongrad, rest, inputs, targets, weights, state, key):
        if constrain is not None:
            inputs, targets, weights = constrain(inputs), constrain(targets), constrain(weights)
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, new_state, aux = _hidden(model, hidden)(inputs, state, deterministic=False, key=key)
        ce = _weighted_ce(model, h, targets, weights)
        extra = sum(aux["losses"].values()) if aux["losses"] else 0.0
        return ce + extra, (ce, new_state, aux)

    return loss_fn


def target_weights(segment_ids):
    """[B, T+1] segment ids of a packed row -> [B, T] float32 weights of its targets: 1 where the target token is in
    the same document as its input token, 0 where it opens the next document (no document predicts another's
    first token, so the loss is the token-weighted mean of the documents' own losses)."""
    return (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)


def make_packed_loss_fn(graphdef, constrain=None, hidden=None):
    """The LM loss of packed rows (``data.packing='segments'``): ``model.hidden`` with the rows' per-token
    ``positions`` and ``segment_ids`` [B, W] (each document attended alone, its positions restarting at 0, the
    carried state starting afresh at its first token), the loss sum(w * nll) / sum(w) over the targets inside a
    document (:func:`target_weights`). ``hidden``: as in :func:`make_loss_fn` (sequence parallelism)."""

    def loss_fn(params, nongrad, rest, inputs, targets, positions, segment_ids, weights, state, key):
        if constrain is not None:
            inputs, targets, weights = constrain(inputs), constrain(targets), constrain(weights)
            positions, segment_ids = constrain(positions), constrain(segment_ids)
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, new_state, aux = _hidden(model, hidden)(inputs, state, deterministic=False, key=key, positions=positions,
                                                   segment_ids=segment_ids)
        ce = _weighted_ce(model, h, targets, weights)
        extra = sum(aux["losses"].values()) if aux["losses"] else 0.0
        return ce + extra, (ce, new_state, aux)

    return loss_fn


# ---- loss scaling

MIN_LOSS_SCALE = 1.0  # a dynamic scale is never halved below this; an overflow at it is a real non-finite gradient
MAX_LOSS_SCALE = 2.0 ** 24  # nor doubled above this


class LossScaleState(NamedTuple):
    """The optimizer state of :class:`LossScaling`: the scale (float32), the finite updates in a row since it
    last changed (int32), and the wrapped optimizer's state."""

    scale: jax.Array
    good_steps: jax.Array
    inner: Any


class LossScaling(NamedTuple):
    """An optax gradient transformation that runs ``inner`` and carries the loss scale in its state. The train
    steps recognise it: they scale the loss, unscale the gradients and update the scale (:func:`_make_update`);
    its own ``update`` passes the scale through unchanged."""

    init: Callable
    update: Callable
    inner: optax.GradientTransformation
    dynamic: bool
    period: int

    def next_scale(self, scale, good_steps, finite):
        """(scale, good_steps) after an update whose gradients were ``finite`` or not."""
        if not self.dynamic:
            return scale, good_steps
        good = jnp.where(finite, good_steps + 1, 0)
        grow = good >= self.period
        new = jnp.where(finite, jnp.where(grow, jnp.minimum(scale * 2.0, MAX_LOSS_SCALE), scale),
                        jnp.maximum(scale * 0.5, MIN_LOSS_SCALE))
        return new.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32)


def loss_scaling(inner: optax.GradientTransformation, *, init: float, dynamic: bool = True,
                 period: int = 2000) -> LossScaling:
    """``inner`` with a loss scale starting at ``init`` in its state (dynamic: halved on overflow, doubled after
    ``period`` finite updates in a row; else fixed)."""

    def init_fn(params):
        return LossScaleState(jnp.asarray(init, jnp.float32), jnp.zeros((), jnp.int32), inner.init(params))

    def update_fn(updates, state, params=None):
        updates, new_inner = inner.update(updates, state.inner, params)
        return updates, state._replace(inner=new_inner)

    return LossScaling(init_fn, update_fn, inner, bool(dynamic), int(period))


def loss_scale_setting(cfg) -> tuple[str, float | None]:
    """('none' | 'dynamic' | 'static', the initial or fixed scale) of a config: ``train.loss_scale`` 'auto' is
    'dynamic' for ``model.dtype='float16'``, else 'none'."""
    tc = cfg.train
    val = str(tc.loss_scale).strip().lower()
    if val == "auto":
        val = "dynamic" if str(cfg.model.dtype) == "float16" else "none"
    if val == "none":
        return "none", None
    if val == "dynamic":
        return "dynamic", float(tc.loss_scale_init)
    return "static", float(val)


def with_loss_scale(tx: optax.GradientTransformation, cfg) -> optax.GradientTransformation:
    """``tx`` wrapped by :func:`loss_scaling` as the config asks (``train.loss_scale``, ``loss_scale_init``,
    ``loss_scale_period``), or ``tx`` itself when the run has no loss scaling."""
    kind, scale = loss_scale_setting(cfg)
    if kind == "none":
        return tx
    return loss_scaling(tx, init=scale, dynamic=kind == "dynamic", period=int(cfg.train.loss_scale_period))


def scaled_value_and_grad(loss_fn):
    """``grad_fn(*args, scale) -> ((loss, aux), grads)``: the gradients of ``scale * loss`` (still scaled), the
    loss unscaled."""

    def scaled(*args, scale):
        loss, aux = loss_fn(*args)
        return loss * scale, (loss, aux)

    vg = jax.value_and_grad(scaled, has_aux=True)

    def grad_fn(*args, scale):
        (_, (loss, aux)), grads = vg(*args, scale=scale)
        return (loss, aux), grads

    return grad_fn


def _unscale(grads, scale):
    """``grads / scale`` computed in float32, returned in each gradient's dtype."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


def _where_tree(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _frozen(trainable):
    """(mask the gradients, keep the frozen parameters): two functions for a static ``trainable`` tree of bools
    (the parameters' structure; None: everything trains, both the identity). A frozen parameter's gradient is
    zero and its value after the update is its value before (so neither weight decay nor stale moments move it);
    the optimizer state keeps its structure, so a run can change what trains when it resumes."""
    if trainable is None:
        return (lambda g: g), (lambda new, old: new)

    def grads(g):
        return jax.tree.map(lambda x, t: x if t else jnp.zeros_like(x), g, trainable)

    def keep(new, old):
        return jax.tree.map(lambda n, o, t: n if t else o, new, old, trainable)

    return grads, keep


def _make_update(graphdef, tx, grad_fn, skip_nonfinite: bool, trainable=None):
    """One optimizer update (and non-gradient update): ``update(carry, (*batch, key))`` with
    carry = (params, nongrad, rest, opt_state, model state) and
    ``grad_fn(params, nongrad, rest, *batch, state, key) -> ((loss, (ce, new_state, aux)), grads)``.
    ``trainable``: a static tree of bools over the parameters, only those True move (:func:`_frozen`)."""

    if isinstance(tx, LossScaling):
        return _make_scaled_update(graphdef, tx, grad_fn, trainable)
    mask_grads, keep_frozen = _frozen(trainable)

    def update(carry, xs):
        params, nongrad, rest, opt_state, state = carry
        *batch, key = xs
        (loss, (ce, new_state, aux)), grads = grad_fn(params, nongrad, rest, *batch, state, key)
        grads = mask_grads(grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = keep_frozen(optax.apply_updates(params, updates), params)
        model = nnx.merge(graphdef, new_params, nongrad, rest)
        model.apply_stats(aux["stats"])
        new_nongrad = nnx.state(model, NonGradState)
        if skip_nonfinite:
            new_params = _where_tree(finite, new_params, params)
            new_opt = _where_tree(finite, new_opt, opt_state)
            new_nongrad = _where_tree(finite, new_nongrad, nongrad)
        metrics = {
            "loss": loss,
            "ce": ce,
            "grad_norm": grad_norm,
            "loss_finite": jnp.isfinite(loss),
            "grad_finite": jnp.isfinite(grad_norm),
            **{f"aux/{k}": v for k, v in aux["losses"].items()},
            **aux["metrics"],
        }
        new_state = jax.lax.stop_gradient(new_state)
        return (new_params, new_nongrad, rest, new_opt, new_state), metrics

    return update


def _make_scaled_update(graphdef, tx: LossScaling, grad_fn, trainable=None):
    """:func:`_make_update` under loss scaling: ``grad_fn(..., scale=)`` returns the gradients of the scaled loss;
    they are unscaled in float32, an update with non-finite gradients is skipped whatever ``train.on_nonfinite``
    says, and the scale in the optimizer state moves (:meth:`LossScaling.next_scale`). Besides the usual metrics:
    ``loss_scale`` (the scale this update used) and ``loss_scale_overflow`` (a dynamic scale's overflow: the loss
    finite, the gradients not, the scale above its minimum -- the loop does not count it as a non-finite step)."""
    mask_grads, keep_frozen = _frozen(trainable)

    def update(carry, xs):
        params, nongrad, rest, opt_state, state = carry
        *batch, key = xs
        scale = opt_state.scale
        (loss, (ce, new_state, aux)), grads = grad_fn(params, nongrad, rest, *batch, state, key, scale=scale)
        grads = mask_grads(_unscale(grads, scale))
        grad_norm = optax.tree.norm(grads)
        loss_finite, grad_finite = jnp.isfinite(loss), jnp.isfinite(grad_norm)
        finite = loss_finite & grad_finite
        updates, new_inner = tx.inner.update(grads, opt_state.inner, params)
        new_params = keep_frozen(optax.apply_updates(params, updates), params)
        model = nnx.merge(graphdef, new_params, nongrad, rest)
        model.apply_stats(aux["stats"])
        new_nongrad = nnx.state(model, NonGradState)
        new_params = _where_tree(finite, new_params, params)
        new_inner = _where_tree(finite, new_inner, opt_state.inner)
        new_nongrad = _where_tree(finite, new_nongrad, nongrad)
        new_scale, good = tx.next_scale(scale, opt_state.good_steps, finite)
        overflow = loss_finite & ~grad_finite & (scale > MIN_LOSS_SCALE) if tx.dynamic else jnp.zeros((), bool)
        metrics = {
            "loss": loss,
            "ce": ce,
            "grad_norm": grad_norm,
            "loss_finite": loss_finite,
            "grad_finite": grad_finite,
            "loss_scale": scale,
            "loss_scale_overflow": overflow,
            **{f"aux/{k}": v for k, v in aux["losses"].items()},
            **aux["metrics"],
        }
        new_opt = LossScaleState(new_scale, good, new_inner)
        new_state = jax.lax.stop_gradient(new_state)
        return (new_params, new_nongrad, rest, new_opt, new_state), metrics

    return update


def _split_rows(x, k: int, axis: int = 0):
    """[..., B, ...] -> [k, ..., B/k, ...]: micro-batch j holds rows j, j+k, j+2k, ... of ``axis``."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // k, k) + shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def _merge_rows(x, axis: int = 0):
    """The inverse of :func:`_split_rows` (``axis`` as in the merged array)."""
    x = jnp.moveaxis(x, 0, axis + 1)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _batch_axes(graphdef, params, nongrad, rest, batch_size: int, k: int, max_len: int):
    """For each leaf of the model state ``init_state(batch_size, max_len)``, its row axis, or None for
    a leaf shared by the rows (e.g. the position): the axis whose size changes with the batch size."""
    def shapes(b):
        return jax.eval_shape(lambda p, n, r: nnx.merge(graphdef, p, n, r).init_state(b, max_len), params, nongrad, rest)

    def axis(big, small):
        diff = [i for i, (x, y) in enumerate(zip(big.shape, small.shape, strict=True)) if x != y]
        if len(diff) > 1:
            raise ValueError(f"a carried state leaf {big.shape} has no single row axis")
        return diff[0] if diff else None

    return jax.tree.map(axis, shapes(batch_size), shapes(batch_size // k))


def _by_axis(f, axes, *trees):
    """``jax.tree.map`` over the leaves of ``axes`` (ints, or None for a shared leaf) and the
    matching parts of ``trees`` (where None stands for a part left out)."""
    return jax.tree.map(f, axes, *trees, is_leaf=lambda x: x is None)


def accumulate_grads(loss_fn, k: int, *, weighted: bool = False, state_axes=None):
    """A ``grad_fn(params, nongrad, rest, *batch, state, key) -> ((loss, (ce, new_state, aux)), grads)``
    over k micro-batches of the rows, equal (up to rounding) to ``value_and_grad(loss_fn)`` on all rows.

    Each micro-batch's cross-entropy is weighted by its share of the batch (1/k; with ``weighted``, its
    share of the scored targets' weight) and its auxiliary losses (means over rows) by 1/k; the
    gradients and the non-gradient ``aux['stats']`` are summed, the reported ``aux`` losses and metrics
    averaged. ``state_axes``: the row axis of each carried state leaf (:func:`_batch_axes`; None for
    a shared leaf), or None when no state is carried. ``grad_fn(..., scale=s)`` (loss scaling): the gradients
    of ``s`` times the loss (still scaled), the reported loss unscaled."""

    def micro_loss(params, nongrad, rest, mb, state, key, ce_w, scale):
        _, (ce, new_state, aux) = loss_fn(params, nongrad, rest, *mb, state, key)
        extra = sum(aux["losses"].values()) if aux["losses"] else 0.0
        total = ce_w * ce + extra / k
        return (total if scale is None else total * scale), (total, ce_w * ce, new_state, aux)

    micro_grad = jax.value_and_grad(micro_loss, has_aux=True)

    def grad_fn(params, nongrad, rest, *batch_and_state_key, scale=None):
        *batch, state, key = batch_and_state_key
        mbs = tuple(_split_rows(a, k) for a in batch)
        if weighted:  # the share of the scored targets' weight (the loss is sum(w * nll) / sum(w))
            w = batch[-1].astype(jnp.float32)
            ce_w = jnp.sum(mbs[-1].astype(jnp.float32), axis=(1, 2)) / jnp.maximum(jnp.sum(w), 1e-9)
        else:
            ce_w = jnp.full((k,), 1.0 / k, jnp.float32)
        keys = jax.random.split(key, k)
        if state is None:
            rows_state, shared_state = None, None
        else:
            rows_state = _by_axis(lambda a, x: None if a is None else _split_rows(x, k, a), state_axes, state)
            shared_state = _by_axis(lambda a, x: x if a is None else None, state_axes, state)

        def body(carry, xs):
            g_acc, _ = carry
            mb, st_rows, key_i, w_i = xs
            st = None if state is None else _by_axis(lambda a, r, sh: sh if a is None else r, state_axes, st_rows,
                                                     shared_state)
            (_, (loss, ce, new_st, aux)), g = micro_grad(params, nongrad, rest, mb, st, key_i, w_i, scale)
            g_acc = jax.tree.map(jnp.add, g_acc, g)
            if state is None or new_st is None:  # one window: no state comes in, none is carried out
                new_rows, new_shared = None, None
            else:
                new_rows = _by_axis(lambda a, x: None if a is None else x, state_axes, new_st)
                new_shared = _by_axis(lambda a, x: x if a is None else None, state_axes, new_st)
            return (g_acc, new_shared), (loss, ce, new_rows, aux)

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, new_shared), (losses, ces, new_rows, auxes) = jax.lax.scan(
            body, (zeros, shared_state), (mbs, rows_state, keys, ce_w))
        if state is None:
            new_state = None
        else:
            new_state = _by_axis(lambda a, r, sh: sh if a is None else _merge_rows(r, a), state_axes, new_rows,
                                 new_shared)
        aux = {"losses": jax.tree.map(lambda v: jnp.mean(v, axis=0), auxes["losses"]),
               "stats": jax.tree.map(lambda v: jnp.sum(v, axis=0), auxes["stats"]),
               "metrics": jax.tree.map(lambda v: jnp.mean(v, axis=0), auxes["metrics"])}
        return (jnp.sum(losses), (jnp.sum(ces), new_state, aux)), grads

    return grad_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, *, seq_len: int, window: int, skip_nonfinite: bool,
                    constrain=None, weighted: bool = False, hidden=None, microbatches: int = 1, packed: bool = False,
                    loss=None, trainable=None):
    """Returns step(params, nongrad, rest, opt_state, tokens[B, T+1], key) -> (params, nongrad, opt_state, metrics).
    A row of T tokens is trained in T // ``window`` windows, one update each, the state carried between them (one
    window where T < ``window``: a staged short row trained whole); ``seq_len``, the longest row, sizes the state.
    ``constrain``: optional function placing [B, W] token arrays on the mesh inside the step.
    ``weighted``: the batch is ``{'tokens': [B, T+1], 'weights': [B, T]}`` and the loss is the weighted
    mean NLL of the targets (a generated source's scored answer tokens; :func:`make_weighted_loss_fn`).
    ``hidden``: optional replacement of ``model.hidden`` taking the model first (sequence parallelism).
    ``microbatches``: gradient accumulation over that many micro-batches of the rows per update
    (:func:`accumulate_grads`; 1 = the whole batch at once).
    ``packed``: the batch is ``{'tokens', 'segment_ids', 'positions': [B, T+1] int32}`` (``data.packing='segments'``,
    :func:`make_packed_loss_fn`; the windows slice the positions and segment ids with the tokens, so a document
    that runs on into the next window keeps its cached keys and one that starts there starts afresh); with
    ``weighted`` also 'weights' [B, T] (packed recall examples: their answer tokens), applied to the targets inside
    a document.
    ``tx`` made by :func:`with_loss_scale` / :func:`loss_scaling`: the updates are loss-scaled.
    ``loss``: another loss function of :func:`make_loss_fn`'s signature (attention transfer,
    :func:`make_transfer_loss_fn`); ``trainable``: a static tree of bools over the parameters, only those True
    are updated (:func:`_frozen`)."""
    if loss is not None:
        if weighted or packed:
            raise ValueError("a given loss function takes neither per-target weights nor packed rows")
    elif packed:
        loss = make_packed_loss_fn(graphdef, constrain, hidden)
    else:
        loss = (make_weighted_loss_fn if weighted else make_loss_fn)(graphdef, constrain, hidden)
    given_weights = weighted  # packed: the batch's weights (else every target inside a document)
    weighted = weighted or packed  # the packed loss's last per-target input is its weights too

    def make_update(params, nongrad, rest, batch_size, n_windows):
        if microbatches == 1:
            grad_fn = (scaled_value_and_grad(loss) if isinstance(tx, LossScaling)
                       else jax.value_and_grad(loss, has_aux=True))
        else:
            if batch_size % microbatches:
                raise ValueError(f"{batch_size} rows do not split into {microbatches} micro-batches")
            axes = (_batch_axes(graphdef, params, nongrad, rest, batch_size, microbatches, seq_len)
                    if n_windows > 1 else None)
            grad_fn = accumulate_grads(loss, microbatches, weighted=weighted, state_axes=axes)
        return _make_update(graphdef, tx, grad_fn, skip_nonfinite, trainable)

    def step(params, nongrad, rest, opt_state, tokens, key):
        rows = tokens["tokens"] if weighted else tokens
        T = rows.shape[1] - 1
        # the row's windows: a row of seq_len in windows of `window`; a staged phase's shorter row in the same
        # windows, or whole where every row is trained whole (window = seq_len)
        n_windows = T // window if T >= window else 1
        update = make_update(params, nongrad, rest, rows.shape[0], n_windows)
        if packed:
            segs, positions = tokens["segment_ids"], tokens["positions"]
            w = target_weights(segs) * tokens["weights"] if given_weights else target_weights(segs)
            tokens = tokens["tokens"]
            per_target = (tokens[:, :-1], tokens[:, 1:], positions[:, :-1], segs[:, :-1], w)
        else:
            if weighted:
                tokens, weights = tokens["tokens"], tokens["weights"]
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            per_target = (inputs, targets, weights) if weighted else (inputs, targets)
        if n_windows == 1:
            (params, nongrad, _, opt_state, _), metrics = update(
                (params, nongrad, rest, opt_state, None), (*per_target, jax.random.fold_in(key, 0))
            )
            return params, nongrad, opt_state, jax.tree.map(lambda m: m[None], metrics)
        B = tokens.shape[0]
        state0 = nnx.merge(graphdef, params, nongrad, rest).init_state(B, seq_len)
        xs = (
            *(a.reshape(B, n_windows, T // n_windows).transpose(1, 0, 2) for a in per_target),
            jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_windows)),
        )
        (params, nongrad, _, opt_state, _), metrics = jax.lax.scan(update, (params, nongrad, rest, opt_state, state0), xs)
        return params, nongrad, opt_state, metrics

    return step


def make_mlm_loss_fn(graphdef, num_masked: int, constrain=None, row_mesh=None):
    """Masked-LM loss: mean NLL over the masked positions only (gathered by index, ``num_masked`` per row).
    ``row_mesh``: the mesh whose ``sequence`` axis splits the rows (XLA partitions the encoder; a fused attention
    kernel runs in a ``shard_map`` over it, ``longctx.attention.row_split``). A batch of packed rows
    (``data.packing='segments'``) also holds 'positions' and 'segment_ids' [B, T]: each document is encoded alone,
    so the loss is the masked-token-weighted mean of the documents' own masked losses."""

    def loss_fn(params, nongrad, rest, batch, state, key):
        inputs, targets, mask = batch["inputs"], batch["targets"], batch["mask"]
        packed = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
        if constrain is not None:
            inputs, targets, mask = constrain(inputs), constrain(targets), constrain(mask)
            packed = {k: constrain(v) for k, v in packed.items()}
        model = nnx.merge(graphdef, params, nongrad, rest)
        with row_split.sequence_mesh(row_mesh):
            h, aux = model.hidden(inputs, mask, deterministic=False, key=key, **packed)
        nll, valid, _ = model.masked_nll(h, targets, mask, num_masked)
        ce = jnp.sum(nll) / jnp.maximum(jnp.sum(valid), 1)
        extra = sum(aux["losses"].values()) if aux["losses"] else 0.0
        return ce + extra, (ce, None, aux)

    return loss_fn


def make_mlm_train_step(graphdef, tx: optax.GradientTransformation, *, num_masked: int, skip_nonfinite: bool,
                        constrain=None, row_mesh=None):
    """Encoder (masked-LM) step: step(params, nongrad, rest, opt_state, batch, key) -> (params, nongrad, opt_state,
    metrics) with batch = {'inputs', 'targets': [B, T] int32, 'mask': [B, T] bool} (longctx.data.masking), and
    'positions', 'segment_ids' [B, T] int32 for packed rows (:func:`make_mlm_loss_fn`).
    One update per row batch: windows do not apply to encoders."""
    loss = make_mlm_loss_fn(graphdef, num_masked, constrain, row_mesh)
    grad_fn = scaled_value_and_grad(loss) if isinstance(tx, LossScaling) else jax.value_and_grad(loss, has_aux=True)
    update = _make_update(graphdef, tx, grad_fn, skip_nonfinite)

    def step(params, nongrad, rest, opt_state, batch, key):
        (params, nongrad, _, opt_state, _), metrics = update(
            (params, nongrad, rest, opt_state, None), (batch, jax.random.fold_in(key, 0))
        )
        return params, nongrad, opt_state, jax.tree.map(lambda m: m[None], metrics)

    return step


def make_mlm_forward(graphdef, num_masked: int):
    """forward(params, nongrad, rest, inputs, targets, mask) -> (nll, correct, valid, idx), each [B, num_masked]:
    deterministic NLL (nats) and argmax-accuracy at the masked positions, and where they are."""

    def forward(params, nongrad, rest, inputs, targets, mask):
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, _ = model.hidden(inputs, mask, deterministic=True)
        hg, tg, valid, idx = model.masked_hidden(h, targets, mask, num_masked)
        nll = jnp.where(valid, model.nll(hg, tg), 0.0)
        correct = (jnp.argmax(model.logits(hg), axis=-1) == tg) & valid
        return nll, correct, valid, idx

    return forward


def make_scored_forward(graphdef):
    """forward(params, nongrad, rest, inputs, targets, state) -> (nll [B, T], correct [B, T], new_state):
    deterministic NLL (nats) and whether the argmax prediction is the target (exact-match scoring)."""

    def forward(params, nongrad, rest, inputs, targets, state):
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, new_state, _ = model.hidden(inputs, state, deterministic=True)
        correct = jnp.argmax(model.logits(h), axis=-1) == targets
        return model.nll(h, targets), correct, new_state

    return forward


def jit_forward(forward):
    """A scoring forward(params, nongrad, rest, inputs, targets, state) jitted with the carried state donated (each
    call's state is the one the previous call returned and is not read again), so a window call does not copy a
    state sized for the longest stream (VCC-LM's or KDEformer's caches: gigabytes at 32k tokens): the trainer's
    validation, ``longctx-eval`` and ``longctx-recall``."""
    return jax.jit(forward, donate_argnums=5)


def make_forward(graphdef):
    """forward(params, nongrad, rest, inputs, targets, state) -> (nll [B, T], new_state), deterministic."""

    def forward(params, nongrad, rest, inputs, targets, state):
        model = nnx.merge(graphdef, params, nongrad, rest)
        h, new_state, _ = model.hidden(inputs, state, deterministic=True)
        return model.nll(h, targets), new_state

    return forward


# ---- attention transfer

TRANSFER_LOSS = "attention_transfer"  # the aux loss (summed over the swapped layers) and the metric's name


class TransferProbe(nnx.Module):
    """A swapped layer's core during attention transfer: runs ``inner`` (the layer's own method) and the exact
    method ``exact`` on the same q, k, v, both under ``stop_gradient`` on q, k, v (only the core's own parameters
    get a gradient), reports mean((inner - exact)^2) over the outputs as the aux loss :data:`TRANSFER_LOSS` and as
    the metric ``transfer_mse`` (``layer{i}/transfer_mse`` in the train record), and hands the exact output on,
    so every layer above sees the exact model's activations (each swapped layer learns on the inputs the exact
    model gives it, as LoLCATs' attention transfer does)."""

    def __init__(self, inner, exact):
        self.inner, self.exact = inner, exact
        self.name, self.causal = inner.name, inner.causal

    def __call__(self, q, k, v, state=None, *, deterministic: bool = True, key=None, aux=None, **kwargs):
        q, k, v = (jax.lax.stop_gradient(a) for a in (q, k, v))
        out, state = self.inner(q, k, v, state, deterministic=deterministic, key=key, aux=aux, **kwargs)
        ref, _ = self.exact(q, k, v, None, deterministic=True, **kwargs)
        ref = jax.lax.stop_gradient(ref)
        with statistic("attention transfer loss"):
            mse = jnp.mean(jnp.square(out.astype(jnp.float32) - ref.astype(jnp.float32)))
        if aux is not None:
            aux.add_loss(TRANSFER_LOSS, mse)
            aux.add_metric("transfer_mse", mse)
        return ref.astype(out.dtype), state

    def init_state(self, batch_size: int, max_len: int | None = None):
        return self.inner.init_state(batch_size, max_len)

    def apply_stats(self, stats) -> None:
        self.inner.apply_stats(stats)


def make_transfer_loss_fn(graphdef, layers, exact_core, constrain=None):
    """The attention-transfer loss (:func:`make_loss_fn`'s signature): the model with each of ``layers``' cores
    wrapped in a :class:`TransferProbe` (``exact_core(core)``: the exact method's core of the same heads), the
    loss the sum over those layers of their transfer MSE plus the methods' own aux losses. The returned ``ce`` is
    the summed transfer MSE (what the train record's ``loss`` shows during transfer; the LM loss of the swapped
    model is what the periodic validation scores)."""

    def loss_fn(params, nongrad, rest, inputs, targets, state, key):
        del targets  # the transfer matches attention outputs; no token is predicted
        if constrain is not None:
            inputs = constrain(inputs)
        model = nnx.merge(graphdef, params, nongrad, rest)
        for i in layers:
            block = model.blocks[i]
            block.core = TransferProbe(block.core, exact_core(block.core))
        _, new_state, aux = model.hidden(inputs, state, deterministic=False, key=key)
        transfer = aux["losses"][TRANSFER_LOSS]
        return sum(aux["losses"].values()), (transfer, new_state, aux)

    return loss_fn
