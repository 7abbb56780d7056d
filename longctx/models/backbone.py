"""The token backbone shared by every model: embedding, positions, a stack of blocks, final norm,
and the output head over the vocabulary (tied to the embedding, untied, or adaptive).

:class:`longctx.models.decoder.DecoderLM` (causal LM) and :class:`longctx.models.encoder.EncoderMLM`
(masked LM) are this module with their own call; they differ only in the ``causal`` flag their
blocks are built with and in what they predict.

    h, new_state, aux = backbone.run(tokens, state, deterministic=True, key=None, important=None)

``state`` = {'pos': int32 scalar (tokens seen), 'layers': [per-block state]} or None (no prefix).
``aux`` = {'losses': {name: scalar summed over layers}, 'stats': [per-layer stats], 'metrics': {...}}.
``important``: optional [B, T] bool of tokens a method may treat specially (VCC's VIP tokens, e.g.
an encoder's masked positions); it reaches every block whose call takes an ``important`` keyword,
and the others never see it.

A method that acts on whole layers rather than on q, k, v (``AttentionCore.stack_wrapper``, e.g.
VCC's compression) replaces the plain loop over the blocks by its stack wrapper, which runs the
same blocks (same parameter tree) and always receives ``important``.
"""

from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
from flax import nnx

from longctx import attention
from longctx.attention import Aux
from longctx.attention.base import logical
from longctx.models.adaptive_softmax import AdaptiveSoftmax, chunked_softmax_nll
from longctx.models.blocks import get_block, split_key
from longctx.models.layers import flat_last, linear, make_norm, sinusoidal_table


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


REMAT_POLICIES = ("auto", "cotangent_tied", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


def resolve_remat_policy(policy: str, backend: str | None = None) -> str:
    """The remat form a block runs under: ``policy`` itself, or for ``'auto'`` the platform's choice:
    ``'cotangent_tied'`` on XLA:CPU (:func:`_remat_after_cotangent`), ``jax.checkpoint`` with
    ``nothing_saveable`` elsewhere (GPU / TPU schedule ``jax.checkpoint``'s recomputation where it belongs)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat policy {policy!r}: allowed: {', '.join(REMAT_POLICIES)}")
    if policy != "auto":
        return policy
    return "cotangent_tied" if (backend or jax.default_backend()) == "cpu" else "nothing_saveable"


def _block_call(deterministic: bool, remat: bool, policy: str = "auto"):
    """``(block, x, state, positions, key, extra) -> (x, state, (losses, stats, metrics))``: one block's call with
    its aux returned as values. ``remat``: a gradient keeps only the block's inputs from the forward and
    recomputes its insides when the backward reaches the block, so the layers' activations (attention weights a
    core keeps for its backward included) never coexist across blocks. ``policy`` (:func:`resolve_remat_policy`):
    ``jax.checkpoint`` with one of ``jax.checkpoint_policies``, or the cotangent-tied custom VJP that XLA:CPU
    needs (:func:`_remat_after_cotangent`)."""

    def call(block, x, st, positions, key, extra):
        aux = Aux()
        x, st = block(x, st, positions=positions, deterministic=deterministic, key=key, aux=aux, **extra)
        return x, st, (aux.losses, aux.stats, aux.metrics)

    if not remat:
        return call
    form = resolve_remat_policy(policy)

    def remat_call(block, x, st, positions, key, extra):
        graphdef, variables = nnx.split(block)
        pure = lambda v, *a: call(nnx.merge(graphdef, v), *a)  # noqa: E731
        if form == "cotangent_tied":
            return _remat_after_cotangent(pure)(variables, x, st, positions, key, extra)
        return jax.checkpoint(pure, policy=getattr(jax.checkpoint_policies, form))(
            variables, x, st, positions, key, extra)

    return remat_call


def _remat_after_cotangent(fn):
    """``fn`` (pure; its second argument the block's input x, its first output x's successor) that a gradient
    differentiates by recomputation: the forward saves the arguments only, the backward re-runs ``fn`` under
    ``jax.vjp``. ``jax.checkpoint`` does the same, but XLA:CPU removes its optimization barriers before scheduling
    and then computes every block's recomputation early, so that all activations are live at once (measured: the
    same compiled temporary memory with and without it). Here the recomputation's inputs are tied to the incoming
    cotangent of x's successor (+ 0·ct[0]), a data dependency that any scheduler must respect: the recomputation
    runs only once the backward has reached the block."""

    @jax.custom_vjp
    def f(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), args

    def bwd(args, ct):
        first = jax.tree.leaves(ct[0])[0]
        tie = 0.0 * first.reshape(-1)[0]
        floating = lambda a: jnp.issubdtype(a.dtype, jnp.floating)  # noqa: E731
        tied = [jax.tree.map(lambda a: a + tie.astype(a.dtype) if floating(a) else a, arg) for arg in args[1:3]]
        _, vjp = jax.vjp(fn, args[0], *tied, *args[3:])
        return vjp(ct)

    f.defvjp(fwd, bwd)
    return f


class Backbone(nnx.Module):
    """Embedding -> positions -> blocks (built with ``cfg.causal``) -> norm, plus the vocabulary head."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg_positions = cfg.positions
        self.d_model = cfg.d_model
        self.vocab_size = cfg.vocab_size
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                               embedding_init=logical(nnx.initializers.normal(0.02), "vocab", "embed"), rngs=rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model,
                                       embedding_init=logical(nnx.initializers.normal(0.02), "position", "embed"),
                                       rngs=rngs)
            self.max_len = cfg.max_len
        else:
            self.pos_embed = None
        block_cls = get_block(cfg.block)
        self.blocks = nnx.List([block_cls(cfg, layer_index=i, rngs=rngs) for i in range(cfg.num_layers)])
        self._block_takes_important = takes_keyword(block_cls.__call__, "important")
        wrapper = attention.get_class(cfg.attention.name).stack_wrapper(causal=cfg.causal)
        if wrapper:
            module_name, cls_name = wrapper.split(":")
            self.stack = getattr(importlib.import_module(module_name), cls_name)(cfg, rngs=rngs)
        else:
            self.stack = None
        self.norm = make_norm(cfg.norm, cfg.d_model, rngs)
        self.remat = bool(cfg.get("remat", False))  # configs saved before the key existed: off
        self.remat_policy = str(cfg.get("remat_policy", "auto"))
        self.output_kind, self.loss_chunk = cfg.output, cfg.loss_chunk
        adaptive = cfg.output == "adaptive"
        self.adaptive = (
            AdaptiveSoftmax(cfg.d_model, cfg.vocab_size, tuple(cfg.adaptive_cutoffs), cfg.adaptive_div, rngs=rngs)
            if adaptive
            else None
        )
        self.head = (
            linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), use_bias=False, rngs=rngs)
            if not adaptive and not cfg.tie_embeddings
            else None
        )

    def init_state(self, batch_size: int, max_len: int | None = None):
        return {
            "pos": jnp.zeros((), jnp.int32),
            "layers": (self.stack.init_state(self.blocks, batch_size, max_len) if self.stack is not None
                       else [b.init_state(batch_size, max_len) for b in self.blocks]),
        }

    def embed_tokens(self, tokens, positions):
        x = self.embed(tokens)
        if self.cfg_positions == "learned":
            x = x + self.pos_embed(jnp.minimum(positions, self.max_len - 1))[None]
        elif self.cfg_positions == "sinusoidal":
            x = x + sinusoidal_table(positions, self.d_model)[None].astype(x.dtype)
        return x

    def logits(self, h):
        """[..., V] fp32 logits (log-probabilities for the adaptive softmax)."""
        if self.adaptive is not None:
            return self.adaptive.log_probs(h)
        if self.head is None:
            return flat_last(self.embed.attend, h).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)

    def nll(self, h, targets):
        """Per-token negative log-likelihood [B, T] in nats, exact for every output kind."""
        if self.adaptive is not None:
            return self.adaptive.nll(h, targets)
        if self.loss_chunk > 0:
            W = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
            return chunked_softmax_nll(h, W, targets, chunk=self.loss_chunk)
        logp = jax.nn.log_softmax(self.logits(h), axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    def run(self, tokens, state=None, *, deterministic: bool = True, key=None, important=None):
        """Final-norm hidden states [B, T, d_model], the new state and the blocks' aux."""
        T = tokens.shape[1]
        pos0 = jnp.zeros((), jnp.int32) if state is None else state["pos"]
        positions = pos0 + jnp.arange(T, dtype=jnp.int32)
        x = self.embed_tokens(tokens, positions)
        layer_states = [None] * len(self.blocks) if state is None else state["layers"]
        if self.stack is not None:
            aux = Aux()
            x, new_states = self.stack(self.blocks, x, layer_states, positions=positions, important=important,
                                       deterministic=deterministic, key=key, aux=aux)
            h = self.norm(x)
            metrics = {f"stack/{name}": val for name, val in aux.metrics.items()}
            return h, {"pos": pos0 + T, "layers": new_states}, {
                "losses": dict(aux.losses), "stats": [{} for _ in self.blocks], "metrics": metrics}
        keys = split_key(key, len(self.blocks))
        extra = {"important": important} if important is not None and self._block_takes_important else {}
        new_states, losses, stats, metrics = [], {}, [], {}
        call = _block_call(deterministic, self.remat, self.remat_policy)
        for i, (block, st, k) in enumerate(zip(self.blocks, layer_states, keys)):
            x, st, (layer_losses, layer_stats, layer_metrics) = call(block, x, st, positions, k, extra)
            new_states.append(st)
            for name, val in layer_losses.items():
                losses[name] = losses.get(name, 0.0) + val
            stats.append(layer_stats)
            for name, val in layer_metrics.items():
                metrics[f"layer{i}/{name}"] = val
        h = self.norm(x)
        new_state = {"pos": pos0 + T, "layers": new_states}
        return h, new_state, {"losses": losses, "stats": stats, "metrics": metrics}

    def apply_stats(self, stats) -> None:
        for block, st in zip(self.blocks, stats):
            if st:
                block.apply_stats(st)
