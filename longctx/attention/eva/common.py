"""What every EVA implementation shares: the static options, the geometry of a pass, the masks and the relative
position bias as functions of absolute positions, the random draws (one ω sample per chunk, attention dropout)
and the decoding state (docs/methods/eva.md; the section numbers (§) are its sections).

Randomness: ``key`` -> ``noise_key, drop_key = jax.random.split(key)``. Chunk ``c`` (absolute index) draws
``normal(fold_in(noise_key, c), (B, H, d))`` (§4.4 / §9.4), in a full pass and when a chunk is finished during
streaming alike. Attention dropout (§9.12) is a counter hash (pallas_kernels/hash_dropout.py, the one copy the
Phase B kernel uses too): ``seed = bits(drop_key)`` (uint32), row ``b·H + h`` gets ``row_seeds(seed, b·H + h)``,
and the weight of query position ``n`` on key position ``m`` is kept iff ``hash(row seed, n, m) >= rate·2^32``,
on chunk ``c`` iff ``hash(row seed, n, 2^31 + c) >= rate·2^32``: absolute indices only, so every implementation
(kernel, tiles, reference, a stream after a carried state) drops the same weights, whatever tiles it scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention import dispatch
from longctx.attention.base import check_capacity
from pallas_kernels import eva_attend_ref, hash_dropout

# Phase A (chunk statistics, §2.3) and the static options live beside the Pallas kernel that must match them
# (pallas_kernels/eva_chunks_ref.py, DESIGN.md "Kernels beside their references"): one copy of the math.
from pallas_kernels.eva_chunks_ref import (  # noqa: F401  (re-exported names)
    LN_EPS,
    NEG,
    EVAOptions,
    chunk_beta,
    chunk_summaries,
    layer_norm,
    representatives,
    rf_log_feature,
)


def geometry(opts: EVAOptions, L: int, chunk_size: int, num_chunks: int):
    """(L_pad, P, C, query tile size) for a full pass over L tokens (§2.1)."""
    W = opts.W
    if num_chunks > 0 and not opts.causal:
        mult = W if W > 0 else num_chunks
        L_pad = -(-L // mult) * mult
        P = L_pad // num_chunks
    else:
        P = chunk_size
        mult = W if W > 0 else P
        L_pad = -(-L // mult) * mult
    C = L_pad // P
    tile = W if W > 0 else P
    return L_pad, P, C, tile


def window_keys(opts: EVAOptions, tile: int) -> int:
    """Tk: the local key slots of a query tile (its window; 0 without a local part)."""
    return tile + opts.e_l + opts.e_r if opts.W > 0 else 0


# ---------------------------------------------------------------------------
# relative position bias (§2.6)
# ---------------------------------------------------------------------------


def rpe_num_buckets(W: int, e: int) -> int:
    return int(min(max((W + e) // 2, 16), 64))


def t5_bucket(delta, num_buckets: int, max_distance: int, causal: bool):
    """T5 bucket of ``delta = key_pos - query_pos`` (int array). A numpy ``delta`` gives numpy buckets, computed
    while tracing (a constant of the compiled program)."""
    xp = np if isinstance(delta, np.ndarray) else jnp
    delta = delta.astype(xp.int32)
    if causal:
        n, offset, t = num_buckets, 0, xp.maximum(-delta, 0)
    else:
        n = num_buckets // 2
        offset = xp.where(delta > 0, n, 0)
        t = xp.abs(delta)
    me = max(n // 2, 1)
    denom = max(math.log(max_distance / me), 1e-6)
    tf = xp.maximum(t, me).astype(xp.float32)
    large = me + xp.floor(xp.log(tf / me) / xp.float32(denom) * (n - me)).astype(xp.int32)
    large = xp.minimum(large, n - 1)
    return xp.where(t < me, t, large) + offset


def rpe_bias(table, q_pos, k_pos, opts: EVAOptions, scale: float):
    """[Hb, Tq, Tk] bias ``s * θ[bucket(k_pos - q_pos)]``; Hb = 1 (causal, shared) or H. Numpy positions: the
    buckets are constants (:func:`t5_bucket`)."""
    b = t5_bucket(k_pos[None, :] - q_pos[:, None], opts.rpe_buckets, opts.rpe_max_distance, opts.causal)
    if table.ndim == 1:
        return scale * table[b][None]
    return scale * jnp.moveaxis(table[b], -1, 0)


def local_bias_tiles(table, opts: EVAOptions, scale: float):
    """The Phase B kernel's bias operand [Hb, n_lt, W, W]: one tile per key-block offset of the window (the bias
    depends on ``offset·W + column − row`` only)."""
    r = np.arange(opts.W)
    tiles = [rpe_bias(table, r, o * opts.W + r, opts, scale) for o in eva_attend_ref.local_offsets(opts.e_l, opts.e_r)]
    return jnp.stack(tiles, axis=1)


# ---------------------------------------------------------------------------
# masks from absolute positions (§2.4, §2.5): the one copy is pallas_kernels/eva_attend_ref.py
# ---------------------------------------------------------------------------


def window_bounds(q_pos, opts: EVAOptions):
    """[lo, hi) of the local window E_w of each query's block."""
    return eva_attend_ref.window_bounds(q_pos, opts.W, opts.e_l, opts.e_r)


def local_mask(q_pos, k_pos, k_valid, opts: EVAOptions):
    """[Tq, Tk] bool: key in the query's window (and not in its future when causal)."""
    return eva_attend_ref.local_mask(q_pos, k_pos, k_valid, W=opts.W, e_l=opts.e_l, e_r=opts.e_r, causal=opts.causal)


def chunk_mask(q_pos, chunk_ids, chunk_valid, P: int, opts: EVAOptions, keys_major: bool = False):
    """[Tq, C] bool ([C, Tq] with keys_major). Causal: chunk c visible iff c < ⌊n/P⌋ (released rule: own chunk
    hidden). 'disjoint': additionally drop chunks intersecting the query's window."""
    return eva_attend_ref.chunk_mask(q_pos, chunk_ids, chunk_valid, P=P, W=opts.W, e_l=opts.e_l, e_r=opts.e_r,
                                     causal=opts.causal, disjoint=opts.partition == "disjoint", keys_major=keys_major)


# ---------------------------------------------------------------------------
# random draws (module docstring)
# ---------------------------------------------------------------------------


def chunk_noise(noise_key, chunk_ids, batch: int, heads: int, dim: int):
    """ε [B,H,C,d]: chunk c draws normal(fold_in(noise_key, c), (B,H,d)) (§4.4)."""
    eps = jax.vmap(lambda c: jax.random.normal(jax.random.fold_in(noise_key, c), (batch, heads, dim)))(chunk_ids)
    return jnp.moveaxis(eps, 0, 2)


def dropout_seeds(drop_key, opts: EVAOptions, batch: int, heads: int):
    """The dropout row seeds int32 [B, H] (module docstring), or None without dropout (no key or rate 0)."""
    if drop_key is None or opts.attn_dropout <= 0.0:
        return None
    seed = hash_dropout.seed_from_key(drop_key)
    return hash_dropout.row_seeds(seed, jnp.arange(batch * heads).reshape(batch, heads))


def dropout_multipliers(seeds, rate: float, q_pos, k_pos, chunk_ids):
    """``keep / (1 − rate)`` of the rows' seeds [B, H] for queries at q_pos [Tq]: on local keys at k_pos [Tk]
    ([B, H, Tq, Tk]) and on chunks chunk_ids [C] ([B, H, Tq, C]), all absolute."""
    m = eva_attend_ref.dropout_multiplier(seeds, q_pos, k_pos, chunk_ids, rate)
    return m[..., :k_pos.shape[0]], m[..., k_pos.shape[0]:]


# ---------------------------------------------------------------------------
# the few ops a tiled implementation takes from its platform (xla.py plain; the CPU-tuned implementation, in its
# own file, passes tuned ones)
# ---------------------------------------------------------------------------


def _plain_row_scale(x, s):
    return x * s[..., None]


@dataclasses.dataclass(frozen=True)
class TileOps:
    """layer_norm: Phase A's LayerNorm; noise: applied to the drawn chunk noise; row_scale(x, s): x · s[..., None];
    fused_groups(ctx) -> run_group or None: a full pass's groups of query tiles, written out for the
    representative-logit estimator without dropout (the CPU-tuned implementation); fused_tile: the same for one
    tile of a stream (``attend_tile``'s arguments plus the masks and bias), or None."""

    layer_norm: Callable = layer_norm
    noise: Callable = lambda x: x  # noqa: E731
    row_scale: Callable = _plain_row_scale
    fused_groups: Callable | None = None
    fused_tile: Callable | None = None

    def summaries(self, stats_fn=None):
        """Phase A: ``stats_fn`` (a kernel), else :func:`chunk_summaries` with this LayerNorm."""
        if stats_fn is not None:
            return stats_fn
        norm = self.layer_norm
        return lambda *a: chunk_summaries(*a, norm=norm)


PLAIN = TileOps()


def uses_fused(seeds, opts: EVAOptions) -> bool:
    """A written-out backward covers the paper's estimator: representative chunk logits, no attention dropout
    (``seeds`` None). 'exact_lse' chunk logits and dropout run through autodiff."""
    return opts.chunk_logit == "rep" and (seeds is None or opts.attn_dropout == 0.0)


# ---------------------------------------------------------------------------
# decoding / streaming state (§4; causal only)
# ---------------------------------------------------------------------------


def empty_state(B, H, d, dv, R, P, C_max, exact: bool):
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    st = {
        "pos": jnp.zeros((), jnp.int32),
        # packed rows (segment ids): the id of the document the state summarizes (0: none) and its tokens so far;
        # a packed call's buffers hold that document's positions counted from its first token (doc_len for pos)
        "segment": jnp.zeros((B,), jnp.int32),
        "doc_len": jnp.zeros((B,), jnp.int32),
        "win_k": z(B, H, R, d),  # last R tokens, chronological: slot j <-> position pos - R + j
        "win_v": z(B, H, R, dv),
        "cur_q": z(B, H, P, d),  # members of the unfinished chunk ⌊pos/P⌋, slot j <-> ⌊pos/P⌋P + j
        "cur_k": z(B, H, P, d),
        "cur_v": z(B, H, P, dv),
        "mem_khat": z(B, H, C_max, d),  # finished chunks c < ⌊pos/P⌋
        "mem_beta": z(B, H, C_max, dv),
    }
    if exact:
        st["mem_kraw"] = z(B, H, C_max, P, d)
    return st


def _last(x, R):
    """Last R entries along axis 2, zero-filled at the front when shorter."""
    n = x.shape[2]
    if n >= R:
        return x[:, :, n - R:]
    return jnp.pad(x, ((0, 0), (0, 0), (R - n, 0), (0, 0)))


def state_from_forward(extras, L: int, R: int, exact: bool):
    """The state the step path would have built after L tokens (§4.3), from a full pass's ``extras``: its
    chunk statistics ``k_hat``, ``beta`` [B,H,C,.] (float32), chunk size ``P`` and the inputs padded to whole chunks
    (``padded``: q, k, v, in the compute dtype; the state keeps them in float32)."""
    qf, kf, vf = (x.astype(jnp.float32) for x in extras["padded"])  # the state is float32 whatever the inputs
    P = extras["P"]
    c_cur = L // P
    cur = [jnp.pad(x, ((0, 0), (0, 0), (0, P), (0, 0)))[:, :, c_cur * P:(c_cur + 1) * P] for x in (qf, kf, vf)]
    B = qf.shape[0]
    st = {
        "pos": jnp.asarray(L, jnp.int32),
        "segment": jnp.zeros((B,), jnp.int32),  # one sequence, no document id
        "doc_len": jnp.full((B,), L, jnp.int32),
        "win_k": _last(kf[:, :, :L], R),
        "win_v": _last(vf[:, :, :L], R),
        "cur_q": cur[0], "cur_k": cur[1], "cur_v": cur[2],
        "mem_khat": extras["k_hat"],
        "mem_beta": extras["beta"],
    }
    if exact:
        _, H, _, d = kf.shape
        st["mem_kraw"] = kf.reshape(B, H, -1, P, d)
    return st


# ---------------------------------------------------------------------------
# the runners' shared call (each implementation module's dispatch.Runner)
# ---------------------------------------------------------------------------

# a runner's fields that the tiles read from the options (EVAOptions): its budgets
OPTION_KNOBS = ("logit_budget", "keep_budget")


def runner_arguments(runner: dispatch.Runner, core, call: dispatch.Call) -> tuple:
    """What every EVA function takes after q, k, v (and a stream's state), from ``call.inputs``
    (``EVAAttention.prepare``): the chunk parameters, the relative-position table, the noise and dropout keys, and the
    core's options with the runner's budgets (its fields among :data:`OPTION_KNOBS`, as they run on the platform)."""
    x = call.inputs
    knobs = {f.name: getattr(runner, f.name) for f in dataclasses.fields(runner) if f.name in OPTION_KNOBS}
    return x["params"], x["rpe"], x["noise_key"], x["drop_key"], dataclasses.replace(core.opts, **knobs)


def run_pass(runner: dispatch.Runner, core, call: dispatch.Call, forward: Callable, stream: Callable,
             packed: Callable | None = None, **kernel) -> dispatch.Result:
    """An implementation's call: ``forward`` over the whole row without a carried state (the result's ``extras``:
    what ``EVAAttention.finish`` builds a causal core's state from, :func:`state_from_forward`), else ``stream``, the
    tokens after ``call.state`` (the result's state); a packed row (segment ids) by ``packed``, from a carried state
    too (the result's state: its last document's); ``kernel``: the keywords both take beyond the shared ones."""
    x, args, c = call.inputs, runner_arguments(runner, core, call), core.cfg
    if x["segment_ids"] is not None and packed is not None:
        out, state = packed(x["q"], x["k"], x["v"], *args, chunk_size=c.chunk_size, segment_ids=x["segment_ids"],
                            state=call.state)
        return dispatch.Result(out, state)
    if call.state is None:
        out, extras = forward(x["q"], x["k"], x["v"], *args, chunk_size=c.chunk_size, num_chunks=c.num_chunks,
                              **kernel)
        return dispatch.Result(out, extras=extras)
    out, state = stream(x["q"], x["k"], x["v"], call.state, *args, P=c.chunk_size, **kernel)
    return dispatch.Result(out, state)


def check_state_capacity(pos, T, P, C_max):
    """The chunk memory must hold every chunk finished by these tokens: a clear error otherwise,
    on the host when ``pos`` is concrete and through a raising host callback under jit."""
    check_capacity((pos + T) // P, C_max,
                   "eva: the decoding state holds {capacity} finished-chunk slots (init_state max_len) but the "
                   "tokens fed so far finish {needed} chunks; build it with core.init_state(batch_size, max_len) "
                   "with a larger max_len")
