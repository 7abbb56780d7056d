"""The token backbone shared by every model: embedding, positions, a stack of blocks, final norm,
and the output head over the vocabulary (tied to the embedding, untied, or adaptive).

:class:`longctx.models.decoder.DecoderLM` (causal LM) and :class:`longctx.models.encoder.EncoderMLM`
(masked LM) are this module with their own call; they differ only in the ``causal`` flag their
blocks are built with and in what they predict.

    h, new_state, aux = backbone.run(tokens, state, deterministic=True, key=None, important=None,
                                     positions=None, segment_ids=None)

``state`` = {'pos': int32 scalar (tokens seen), 'layers': [per-block state]} or None (no prefix); scanned: the
per-block states stacked (one tree, leading layer axis).
``aux`` = {'losses': {name: scalar summed over layers}, 'stats': [per-layer stats], 'metrics': {...}}.
``important``: optional [B, T] bool of tokens a method may treat specially (VCC's VIP tokens, e.g.
an encoder's masked positions); it reaches every block whose call takes an ``important`` keyword,
and the others never see it. ``positions`` / ``segment_ids``: optional [B, T] int32 of a packed row
(``data.packing='segments'``, :meth:`Backbone.run`).

``model.scan_layers='on'`` (:func:`scans_layers`; ``'auto'``, the default, is resolved by
:func:`longctx.config.validate`): the blocks' variables (parameters and non-gradient state such as VQ codebooks) are
stacked on a leading ``layers`` axis (:class:`LayerStack`) and one ``jax.lax.scan`` runs them, so a step
compiles one block whatever the depth. The layout is the only difference: the blocks are built exactly as
unrolled ones (same initial values for the same seed) and then stacked; per-layer keys are the same
``split(key, num_layers)``; the per-layer decoding state is stacked too (``state['layers']`` one tree whose
leaves have the layer axis first), as are ``aux['stats']``; ``aux['losses']`` are summed over layers and
``aux['metrics']`` keep their ``layer{i}/...`` names. :func:`relayout` converts a tree (parameters, optimizer
moments, checkpoints) between the two layouts.

``model.attention.pattern`` (:func:`longctx.models.blocks.layer_methods`): each layer's own attention method
(a hybrid stack, e.g. three EVA layers and one exact layer repeated to the depth); every block is built with the
model section as its layer sees it (``attention.name`` = its method, :func:`longctx.models.blocks.layer_config`),
so its parameters, non-gradient state, decoding state and stats are that method's, in the same per-layer lists.
Without a pattern every layer runs ``model.attention.name`` and the model is built exactly as before. A pattern
refuses a stack-wrapper method whose wrapper cannot run one layer and, for now, ``scan_layers='on'`` over
different methods (:func:`_check_pattern`).

A method that acts on whole layers rather than on q, k, v (``AttentionCore.stack_wrapper``, e.g.
VCC's compression) replaces the plain loop over the blocks by its stack wrapper, which runs the
same blocks (same parameter tree) and always receives ``important``. In a pattern, a layer whose method's
wrapper declares ``per_layer`` (its stack is a loop of independent per-layer calls, e.g. VCC-LM) runs through
the wrapper's ``layer(block, x, state, deterministic=, key=)`` on its own block, with the state its
``init_layer_state(block, batch_size, max_len)`` builds, in the model's per-layer state list.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longctx import attention
from longctx.attention import Aux, dispatch
from longctx.attention.base import LayerOfStack, axes, logical, segments_refusal
from longctx.errors import ConfigError
from longctx.layout import rows_apply
from longctx.models import precision
from longctx.models.adaptive_softmax import AdaptiveSoftmax, chunked_softmax_nll
from longctx.models.blocks import get_block, layer_config, layer_methods, split_key
from longctx.models.layers import HeadTransform, Identity, linear, make_norm, sinusoidal_table
from longctx.models.sequence_shard import SequenceShard


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# model.scan_layers: 'auto' is resolved by longctx.config.validate to 'on' or 'off' (longctx/config.py)
SCAN_LAYERS = ("auto", "on", "off")


def scans_layers(model_cfg) -> bool:
    """Whether a model section (or its saved dict) stacks its blocks under one scan: ``model.scan_layers`` as
    :func:`longctx.config.validate` resolved it, ``'on'``. A section never validated still holds ``'auto'`` and is
    built unrolled, as ``'off'``."""
    return model_cfg["scan_layers"] == "on"


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
    runs only once the backward has reached the block.

    As under ``jax.checkpoint``, the backward differentiates with respect to the perturbed inputs only (the
    parameters and x in training; the carried state, positions, key and non-gradient variables are constants
    there, and their cotangents are zeros): differentiating a window's carried state would linearize paths no
    gradient takes (Transformer-VQ's tiled form declares its cache counts constant, and JAX's scan transpose
    then fails on that symbolic-zero cotangent)."""

    @jax.custom_vjp
    def f(*args):
        return fn(*args)

    trees = []  # the arguments' structures (the same in every trace of f; residuals hold arrays only)

    def fwd(*primals):
        # per argument, its leaves' values split by whether they are perturbed (None marks the other kind's slot)
        flat = [jax.tree.flatten(a, is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal))
                for a in primals]
        trees[:] = [tree for _, tree in flat]
        varied = [[p.value if p.perturbed else None for p in leaves] for leaves, _ in flat]
        fixed = [[None if p.perturbed else p.value for p in leaves] for leaves, _ in flat]
        args = [tree.unflatten([p.value for p in leaves]) for leaves, tree in flat]
        return fn(*args), (varied, fixed)

    def bwd(res, ct):
        varied, fixed = res
        ct = jax.tree.map(_instantiate_zero, ct, is_leaf=lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero))
        first = jax.tree.leaves(ct[0])[0]
        tie = 0.0 * first.reshape(-1)[0]

        def tied(i, a):  # x and the state (arguments 1 and 2) wait for the cotangent
            if i in (1, 2) and a is not None and jnp.issubdtype(a.dtype, jnp.floating):
                return a + tie.astype(a.dtype)
            return a

        varied = [[tied(i, a) for a in leaves] for i, leaves in enumerate(varied)]
        fixed = [[tied(i, a) for a in leaves] for i, leaves in enumerate(fixed)]

        def of_varied(*vs):
            it = iter(vs)
            args = [tree.unflatten([next(it) if v is not None else c for v, c in zip(vl, cl)])
                    for tree, vl, cl in zip(trees, varied, fixed)]
            return fn(*args)

        _, vjp = jax.vjp(of_varied, *[a for leaves in varied for a in leaves if a is not None])
        it = iter(vjp(ct))
        return tuple(tree.unflatten([next(it) if v is not None else None for v in vl])
                     for tree, vl in zip(trees, varied))

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _instantiate_zero(c):
    """A symbolic zero cotangent as an array (float0 for an integer output), anything else as it is."""
    if not isinstance(c, jax.custom_derivatives.SymbolicZero):
        return c
    if c.dtype == jax.dtypes.float0:
        return np.zeros(c.shape, jax.dtypes.float0)
    return jnp.zeros(c.shape, c.dtype)


def _per_row(table, positions):
    """A position table read at ``positions``: [T] positions shared by the rows (broadcast over them), or [B, T]
    per-row positions (a packed row) as they are."""
    return table[None] if positions.ndim == 1 else table


LAYER_AXIS = "layers"  # the logical name of the stacked axis (longctx/train/sharding.py maps it to no mesh axis)
STACKED_KEY = "layer"  # LayerStack's child: a scanned model's blocks live under blocks/layer/...


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _stack_leaf(*leaves):
    """One layer axis in front of equal-shaped leaves: arrays, abstract arrays, or Variables (whose logical
    axis names get ``'layers'`` in front)."""
    first = leaves[0]
    if _is_var(first):
        value = _stack_leaf(*(v.get_value() for v in leaves))
        names = first.get_metadata().get("out_sharding")
        return first.replace(value, **({"out_sharding": (LAYER_AXIS, *names)} if names is not None else {}))
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack([jnp.asarray(x) for x in leaves])


def _unstack_leaf(leaf, i: int):
    """Layer ``i`` of a stacked leaf (the inverse of :func:`_stack_leaf`)."""
    if _is_var(leaf):
        names = leaf.get_metadata().get("out_sharding")
        extra = {"out_sharding": tuple(names[1:])} if names is not None and names[:1] == (LAYER_AXIS,) else {}
        return leaf.replace(_unstack_leaf(leaf.get_value(), i), **extra)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[i]


def stack_layers(trees):
    """Per-layer trees of one structure -> one tree whose leaves have the layer axis first."""
    return jax.tree.map(_stack_leaf, *trees, is_leaf=_is_var)


def unstack_layers(tree, num_layers: int):
    """The inverse of :func:`stack_layers`: ``num_layers`` per-layer trees."""
    return [jax.tree.map(lambda x, i=i: _unstack_leaf(x, i), tree, is_leaf=_is_var) for i in range(num_layers)]


def _raw(node):
    """The mapping itself (an ``nnx.State``'s nested levels are plain dicts; reading through the State would
    wrap each in a new State and change the tree's structure)."""
    return node.raw_mapping if isinstance(node, nnx.State) else node


def _rebuild(node, items: dict):
    """A mapping of ``node``'s type (an ``nnx.State``, a dict, ...) holding ``items``."""
    if isinstance(node, nnx.State):
        return type(node)(items, _copy=False)
    return items if type(node) is dict else type(node)(items)


def layer_layout(tree) -> str | None:
    """``'scanned'`` or ``'unrolled'``: the layout of the blocks in ``tree`` (a model's state, a checkpoint's
    items, optimizer moments, ...), or None where it holds no blocks."""
    found = []

    def visit(node):
        if isinstance(node, Mapping):
            node = _raw(node)
            blocks = node.get("blocks")
            if isinstance(blocks, Mapping) and blocks:
                found.append("scanned" if STACKED_KEY in blocks else "unrolled")
            for v in node.values():
                visit(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                visit(v)

    visit(tree)
    return found[0] if found else None


def relayout(tree, *, scanned: bool):
    """``tree`` with every ``blocks`` mapping in the other layout: unrolled ``blocks/{0..L-1}/...`` ->
    ``blocks/layer/...`` stacked on a leading layer axis (``scanned=True``), or back (``scanned=False``).
    Works on any tree that holds model variables: an ``nnx.State`` of Variables, a checkpoint's items of arrays
    or abstract arrays, optimizer states (NamedTuples of such trees). Parts already in the asked layout are left
    as they are."""

    def visit(node):
        if isinstance(node, Mapping):
            items = {}
            for k, v in _raw(node).items():
                if k == "blocks" and isinstance(v, Mapping) and v:
                    v = _convert_blocks(v, scanned)
                items[k] = visit(v) if k != "blocks" else v
            return _rebuild(node, items)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(visit(v) for v in node))
        if isinstance(node, (list, tuple)):
            return type(node)(visit(v) for v in node)
        return node

    return visit(tree)


def _convert_blocks(node: Mapping, scanned: bool):
    blocks = _raw(node)
    is_scanned = STACKED_KEY in blocks
    if is_scanned == scanned:
        return blocks
    if scanned:
        keys = sorted(blocks, key=int)
        if keys != list(range(len(keys))):
            raise ValueError(f"blocks {keys}: expected layers 0..{len(keys) - 1}")
        return _rebuild(node, {STACKED_KEY: stack_layers([_raw(blocks[k]) for k in keys])})
    stacked = _raw(blocks[STACKED_KEY])
    leaves = jax.tree.leaves(stacked, is_leaf=_is_var)
    num = (leaves[0].get_value() if _is_var(leaves[0]) else leaves[0]).shape[0]
    return _rebuild(node, dict(enumerate(unstack_layers(stacked, num))))


class LayerStack(nnx.Module):
    """``num_layers`` identical blocks as one block module whose every variable has a leading layer axis
    (logical name ``'layers'``): built from the unrolled blocks, so a scanned model starts from the same
    values as an unrolled one of the same seed."""

    def __init__(self, blocks):
        self.num_layers = len(blocks)
        graphdef, _ = nnx.split(blocks[0])
        self.layer = nnx.merge(graphdef, stack_layers([nnx.state(b) for b in blocks]))

    def __len__(self) -> int:
        return self.num_layers

    def split(self):
        """(graphdef of one block, its stacked variables)."""
        return nnx.split(self.layer)

    def init_state(self, batch_size: int, max_len: int | None):
        graphdef, variables = self.split()
        return jax.vmap(lambda v: nnx.merge(graphdef, v).init_state(batch_size, max_len))(variables)

    def apply_stats(self, stats) -> None:
        """Each layer's non-gradient update from its slice of the stacked ``stats``."""
        if not jax.tree.leaves(stats):
            return
        graphdef, variables = self.split()

        def one(v, st):
            block = nnx.merge(graphdef, v)
            block.apply_stats(st)
            return nnx.state(block)

        nnx.update(self.layer, jax.vmap(one)(variables, stats))


def stack_wrapper_class(name: str, causal: bool):
    """The class of method ``name``'s stack wrapper for the direction ``causal`` (``AttentionCore.stack_wrapper``),
    or None where the method runs on the plain loop of blocks."""
    wrapper = attention.get_class(name).stack_wrapper(causal=causal)
    if not wrapper:
        return None
    module_name, cls_name = wrapper.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def _check_pattern(cfg, methods: tuple[str, ...], scan_layers: bool) -> None:
    """The combinations a per-layer pattern of methods (``model.attention.pattern``) cannot run, as one-line
    ConfigErrors (also raised by :func:`longctx.config.validate`)."""
    for name in dict.fromkeys(methods):
        wrapper = stack_wrapper_class(name, cfg.causal)
        if wrapper is not None and not getattr(wrapper, "per_layer", False):
            raise ConfigError(f"model.attention.pattern: {name!r} runs the whole stack of blocks inside its own "
                              "stack wrapper and cannot be one layer of a pattern; use model.attention.name without "
                              "a pattern")
    if scan_layers and len(set(methods)) > 1:
        raise ConfigError(f"model.scan_layers='on' with a pattern of different methods {tuple(dict.fromkeys(methods))} "
                          "is not supported yet (the scan needs identical blocks); set model.scan_layers='off' or 'auto'")


class Backbone(nnx.Module):
    """Embedding -> positions -> blocks (built with ``cfg.causal``) -> norm, plus the vocabulary head."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, platform: str | None = None):
        """``platform``: where the model runs (its layers' row layout, its attention cores' implementations); None:
        the default backend at build time."""
        platform = platform or dispatch.current_platform()
        self.cfg_positions = cfg.positions
        self.d_model = cfg.d_model
        self.vocab_size = cfg.vocab_size
        # the precision policy, applied here and in the blocks' constructors (longctx/models/precision.py)
        self.policy = pol = precision.policy(cfg, platform)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                               embedding_init=logical(nnx.initializers.normal(0.02), "vocab", "embed"), rngs=rngs,
                               **pol.layer_kw)
        # model.position_offset (RoBERTa's padding_idx + 1): position p reads row p + offset of the learned table
        self.position_offset = int(cfg.position_offset)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Embed(cfg.max_len + self.position_offset, cfg.d_model,
                                       embedding_init=logical(nnx.initializers.normal(0.02), "position", "embed"),
                                       rngs=rngs, **pol.layer_kw)
            self.max_len = cfg.max_len
        else:
            self.pos_embed = None
        # model.type_vocab_size (BERT's token types): a table whose row 0 every token adds (no segment ids); its
        # first axis is named 'position', the small replicated tables' name
        types = int(cfg.type_vocab_size)
        self.type_embed = nnx.Embed(types, cfg.d_model, embedding_init=logical(nnx.initializers.normal(0.02),
                                                                              "position", "embed"),
                                    rngs=rngs, **pol.layer_kw) if types else None
        # model.post_norm: the blocks end in a norm, so the embeddings get one and the stack's last norm is none
        post_norm = bool(cfg.post_norm)
        self.embed_norm = make_norm(cfg.norm, cfg.d_model, rngs, pol, eps=float(cfg.norm_eps)) if post_norm else None
        block_cls = get_block(cfg.block)
        self.scan_layers = scans_layers(cfg)
        methods = layer_methods(cfg)
        pattern = bool(cfg.attention.pattern)
        if pattern:
            _check_pattern(cfg, methods, self.scan_layers)
        blocks = [block_cls(layer_config(cfg, i), layer_index=i, rngs=rngs, platform=platform)
                  for i in range(cfg.num_layers)]
        self.blocks = LayerStack(blocks) if self.scan_layers else nnx.List(blocks)
        self._block_takes_important = takes_keyword(block_cls.__call__, "important")
        wrappers = [stack_wrapper_class(m, cfg.causal) for m in methods]
        self.stack_method = next((m for m, w in zip(methods, wrappers) if w is not None), methods[0])  # for refusals
        if any(wrappers) and self.scan_layers:
            raise ValueError(f"model.scan_layers='on': attention {self.stack_method!r} runs the blocks inside its own "
                             "stack wrapper; set model.scan_layers='off' or 'auto'")
        # no pattern: the wrapper runs the whole stack; in a pattern: each of its layers (``per_layer``), None where
        # a layer runs on the plain loop
        self.stack = wrappers[0](cfg, rngs=rngs) if wrappers[0] is not None and not pattern else None
        self.layer_stacks = nnx.List([w(layer_config(cfg, i), rngs=rngs) if w is not None else None
                                      for i, w in enumerate(wrappers)]) if pattern and any(wrappers) else None
        self.norm = make_norm(cfg.norm, cfg.d_model, rngs, pol, eps=float(cfg.norm_eps)) if not post_norm else Identity()
        # model.head_transform, model.head_bias: BERT's masked-LM head (transform, then the tied output plus a bias)
        self.head_transform = HeadTransform(cfg.d_model, norm=cfg.norm, eps=float(cfg.norm_eps), rngs=rngs,
                                            exact=cfg.mlp == "gelu_exact", policy=pol) \
            if cfg.head_transform else None
        self.head_bias = nnx.Param(jnp.zeros((cfg.vocab_size,), pol.param), **axes("vocab")) \
            if cfg.head_bias else None
        self.remat = bool(cfg.remat)
        # 'auto' resolved for the platform the model is built for (resolve_remat_policy)
        self.remat_policy = resolve_remat_policy(str(cfg.remat_policy), platform)
        self.output_kind, self.loss_chunk = cfg.output, cfg.loss_chunk
        adaptive = cfg.output == "adaptive"
        self.adaptive = (
            AdaptiveSoftmax(cfg.d_model, cfg.vocab_size, tuple(cfg.adaptive_cutoffs), cfg.adaptive_div, rngs=rngs,
                            param_dtype=pol.param, dtype=pol.compute, flat_rows=pol.flat_rows)
            if adaptive
            else None
        )
        self.head = (
            linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), use_bias=False, rngs=rngs, **pol.layer_kw,
                   **pol.rows_kw)
            if not adaptive and not cfg.tie_embeddings
            else None
        )

    def layer_wrappers(self):
        """Per block: the stack wrapper that runs it as one layer of a pattern, or None (its own call)."""
        return [None] * len(self.blocks) if self.layer_stacks is None else list(self.layer_stacks)

    def init_state(self, batch_size: int, max_len: int | None = None):
        return {
            "pos": jnp.zeros((), jnp.int32),
            "layers": (self.stack.init_state(self.blocks, batch_size, max_len) if self.stack is not None
                       else self.blocks.init_state(batch_size, max_len) if self.scan_layers
                       else [b.init_state(batch_size, max_len) if w is None else w.init_layer_state(b, batch_size, max_len)
                             for b, w in zip(self.blocks, self.layer_wrappers())]),
        }

    def embed_tokens(self, tokens, positions):
        x = self.embed(tokens)
        if self.cfg_positions == "learned":
            x = x + _per_row(self.pos_embed(jnp.minimum(positions, self.max_len - 1) + self.position_offset),
                             positions)
        elif self.cfg_positions == "sinusoidal":
            x = x + _per_row(sinusoidal_table(positions, self.d_model), positions).astype(x.dtype)
        if self.type_embed is not None:
            x = x + self.type_embed.embedding[0].astype(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def logits(self, h):
        """[..., V] fp32 logits (log-probabilities for the adaptive softmax)."""
        if self.adaptive is not None:
            return self.adaptive.log_probs(h)
        if self.head_transform is not None:
            h = self.head_transform(h)
        return self._vocab_logits(h)

    def _vocab_logits(self, h):
        """The dense output projection of (transformed) hidden states, plus ``head_bias``: [..., V] fp32."""
        if self.head_bias is not None:
            return self._projected(h) + self.head_bias[...].astype(jnp.float32)
        return self._projected(h)

    def _projected(self, h):
        if not self.policy.full:  # compute-dtype operands, float32 accumulation and logits (the loss's input)
            W = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
            cd = self.policy.compute
            return rows_apply(lambda x: precision.einsum_f32("...d,dv->...v", x.astype(cd), W.astype(cd)), h,
                              flat=self.policy.flat_rows)
        if self.head is None:
            return rows_apply(self.embed.attend, h, flat=self.policy.flat_rows).astype(jnp.float32)
        return self.head(h).astype(jnp.float32)

    def nll(self, h, targets):
        """Per-token negative log-likelihood [B, T] in nats, exact for every output kind."""
        if self.adaptive is not None:
            return self.adaptive.nll(h, targets)
        if self.head_transform is not None:
            h = self.head_transform(h)
        if self.loss_chunk > 0:
            W = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
            bias = None if self.head_bias is None else self.head_bias[...].astype(jnp.float32)
            return chunked_softmax_nll(h, W, targets, chunk=self.loss_chunk, bias=bias)
        logp = jax.nn.log_softmax(self._vocab_logits(h), axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    def run(self, tokens, state=None, *, deterministic: bool = True, key=None, important=None, positions=None,
            segment_ids=None):
        """Final-norm hidden states [B, T, d_model], the new state and the blocks' aux. A packed row
        (``data.packing='segments'``) brings ``positions`` [B, T] (restarting at 0 at each document: every position
        encoding reads them) and ``segment_ids`` [B, T] (each block hands them its core, which attends within a
        document and starts its carried state afresh at each boundary); without them the positions are the row's,
        counted on from ``state['pos']``."""
        T = tokens.shape[1]
        pos0 = jnp.zeros((), jnp.int32) if state is None else state["pos"]
        if positions is None:
            positions = pos0 + jnp.arange(T, dtype=jnp.int32)
        elif positions.shape != tokens.shape:
            raise ValueError(f"positions {positions.shape} must be [batch, length] = {tokens.shape}")
        x = self.embed_tokens(tokens, positions)
        layer_states = [None] * len(self.blocks) if state is None else state["layers"]
        wrappers = [self.stack] if self.stack is not None else [w for w in self.layer_wrappers() if w is not None]
        if segment_ids is not None and not all(w.takes_segments for w in wrappers):
            raise ConfigError(segments_refusal(self.stack_method))  # a stack wrapper that takes no segment ids
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        if self.stack is not None:
            aux = Aux()
            x, new_states = self.stack(self.blocks, x, layer_states, positions=positions, important=important,
                                       deterministic=deterministic, key=key, aux=aux, **seg)
            h = self.norm(x)
            metrics = {f"stack/{name}": val for name, val in aux.metrics.items()}
            return h, {"pos": pos0 + T, "layers": new_states}, {
                "losses": dict(aux.losses), "stats": [{} for _ in self.blocks], "metrics": metrics}
        extra = {"important": important} if important is not None and self._block_takes_important else {}
        if segment_ids is not None:
            extra["segment_ids"] = segment_ids
        if self.scan_layers:
            x, new_states, aux = self._run_scanned(x, None if state is None else state["layers"], positions, extra,
                                                   deterministic=deterministic, key=key)
            return self.norm(x), {"pos": pos0 + T, "layers": new_states}, aux
        keys = split_key(key, len(self.blocks))
        new_states, losses, stats, metrics = [], {}, [], {}
        call = _block_call(deterministic, self.remat, self.remat_policy)
        for i, (block, st, k, wrap) in enumerate(zip(self.blocks, layer_states, keys, self.layer_wrappers())):
            if wrap is not None:  # a pattern's layer run by its method's stack wrapper (``per_layer``)
                x, st = wrap.layer(block, x, st, deterministic=deterministic, key=k, **seg)
                layer_losses, layer_stats, layer_metrics = {}, {}, {}
            else:
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

    def _run_scanned(self, x, layer_states, positions, extra, *, deterministic, key):
        """The stacked blocks under one ``jax.lax.scan`` (the body: one block's call, rematerialised per
        ``model.remat`` / ``model.remat_policy`` as an unrolled block is; the scan's backward visits the layers
        one at a time, so the recomputation of either form runs only when the backward reaches its layer).
        ``layer_states``: None, the stacked per-layer states, or one :class:`SequenceShard` per layer (the
        composed sequence-parallel hook; their ``initial`` states are stacked and each layer gets its own)."""
        L = len(self.blocks)
        graphdef, variables = self.blocks.split()
        shard = None
        if isinstance(layer_states, (list, tuple)) and layer_states and isinstance(layer_states[0], SequenceShard):
            shard = layer_states[0]
            initials = [s.initial for s in layer_states]
            layer_states = None if all(i is None for i in initials) else stack_layers(initials)
        keys = None if key is None else jax.random.split(key, L)
        call = _block_call(deterministic, self.remat, self.remat_policy)

        def body(x, xs):
            v, st, k = xs
            if shard is not None:
                st = dataclasses.replace(shard, initial=st)
            x, st, (losses, stats, metrics) = call(nnx.merge(graphdef, v), x, st, positions, k, extra)
            return x, (st, losses, stats, metrics)

        if layer_states is not None and shard is None and deterministic:
            # evaluation and decoding: the stacked states in the carry, each layer's core given its slot of them
            # (LayerOfStack), so a decoding step writes its token into the donated stack in place (as scan
            # inputs and outputs, XLA copied the whole stack every step); differentiated calls keep them as scan
            # inputs and outputs (the carry would be kept per layer for the backward)
            def carried(carry, xs):
                x, stack = carry
                v, k, i = xs
                x, st, (losses, stats, metrics) = call(nnx.merge(graphdef, v), x, LayerOfStack(stack, i), positions,
                                                       k, extra)
                return (x, st.stack), (losses, stats, metrics)

            (x, new_states), (losses, stats, metrics) = jax.lax.scan(
                carried, (x, layer_states), (variables, keys, jnp.arange(L, dtype=jnp.int32)))
        else:
            x, (new_states, losses, stats, metrics) = jax.lax.scan(body, x, (variables, layer_states, keys))
        losses = {name: jnp.sum(val, axis=0) for name, val in losses.items()}
        metrics = {f"layer{i}/{name}": val[i] for i in range(L) for name, val in metrics.items()}
        return x, new_states, {"losses": losses, "stats": stats, "metrics": metrics}

    def apply_stats(self, stats) -> None:
        if self.scan_layers:
            self.blocks.apply_stats(stats)
            return
        for block, st in zip(self.blocks, stats):
            if st:
                block.apply_stats(st)
