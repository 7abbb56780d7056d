"""VCC's fidelity fixes: where the paper or the released code was silent or wrong (docs/DESIGN.md, "Where the
specs were silent or wrong"; docs/methods/vcc.md §2.8, §4.2, §8.5, §8.14, §8.15), the behaviour fixed here and its
regression test.

- Padding: a partly padded block's position is the rounded mean of its valid members (the release: of all
  members), and a VIP flag on a padding token is dropped (no slot, no weight in the score, not overflow).
- A row with no VIP token uses its filled slots (its earliest tokens) as the selection's queries (the release's
  score is then the same for every block), counted in ``vip_empty_rows`` and logged once.
- More VIPs than slots keeps the release's behaviour (the surplus is compressed), counted in ``vip_overflow``
  and logged once per process, also under jit.
- VCC-LM exploration ranks only a window's old blocks, so an explored window refines min(h, old blocks) usable
  blocks, as an unexplored one does.

The fixture comparison with the release is tests/fidelity/test_vcc_release.py; the method's own properties
(docs/methods/vcc.md §6) are tests/attention/test_vcc.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longctx.attention.vcc import stack as vs
from tests.attention.test_vcc import B, build, call, hidden, inputs


def test_padding_departures_block_position_and_vip_flags():
    """Two departures from the release under padding (docs/methods/vcc.md §8.14): a partly padded block's
    position is the rounded mean of its *valid* members (the release: of all members), and a VIP flag on a
    padding token is dropped (no slot, no weight in the score, not counted as overflow)."""
    T, n_p, k = 14, 2, 4
    x = jax.random.normal(jax.random.key(0), (1, T, 3))
    pos = jnp.arange(T)[None]
    valid = np.ones((1, T), bool)
    valid[0, [5, 6]] = False  # block 1 = tokens 5..8 (after the slots 0, 11 and block 1..4): valid members 7, 8
    vip = np.zeros((1, T), bool)
    vip[0, [0, 6, 11]] = True  # 6 is padding: its flag is dropped; 0 and 11 fill the two slots
    st, overflow = jax.jit(vs.format_rows, static_argnums=(4, 5))(x, jnp.asarray(vip), jnp.asarray(valid), pos,
                                                                 n_p, k)
    assert np.asarray(st.perm)[0, :2].tolist() == [0, 11] and np.asarray(st.imp)[0].tolist() == [True, True]
    assert int(overflow[0]) == 0  # the flag on padding is not a surplus VIP
    assert np.asarray(st.tok_pos)[0, 1].tolist() == [5, 6, 7, 8]
    assert int(st.coarse_pos[0, 1]) == 8  # round-half-even(7.5); all members would give round(6.5) = 6
    assert int(st.coarse_pos[0, 0]) == 2  # a whole block: round-half-even(mean of 1..4 = 2.5) = 2
    assert np.asarray(st.tok_valid)[0, 1].tolist() == [False, False, True, True]


def test_rows_without_vip_tokens_select_from_their_leading_slots(caplog):
    """A row with no VIP token (or ``important=None``) would score every block log(1e-5) and refine the first h
    blocks whatever the input; instead its slots (filled by its earliest tokens) act as the VIP queries,
    the rows are counted (``vip_empty_rows``) and the fallback is logged once (docs/methods/vcc.md §2.8)."""
    T, n_p, k = 24, 4, 4
    x = jax.random.normal(jax.random.key(0), (B, T, 3))
    vip = np.zeros((B, T), bool)
    vip[1, [2, 7]] = True
    st, _ = jax.jit(vs.format_rows, static_argnums=(4, 5))(x, jnp.asarray(vip), jnp.ones((B, T), bool),
                                                          jnp.broadcast_to(jnp.arange(T), (B, T)), n_p, k)
    assert np.asarray(st.imp)[0].tolist() == [True] * n_p  # no VIP: every filled slot counts
    assert np.asarray(st.imp)[1].tolist() == [True, True, False, False]  # VIPs: only they count
    model = build(num_vip=8)
    tokens, _ = inputs(40, seed=3)
    vs._warned.clear()
    with caplog.at_level("WARNING", logger="longctx.attention.vcc.stack"):
        _, _, infos = hidden(model, tokens)
        jax.effects_barrier()
    assert sum("no VIP token" in r.getMessage() for r in caplog.records) == 1, caplog.text
    for info in infos:  # the score depends on the blocks, not a constant log(1e-5)
        assert float(jnp.max(jnp.std(info["ell"], axis=1))) > 1e-4


def test_vip_overflow_and_rows_without_vips_are_counted_and_logged_once(caplog):
    """The spec keeps the release's overflow semantics (the surplus is compressed, counted in ``vip_overflow``);
    the stack also logs it, once per process, even under jit; likewise rows with no VIP token
    (``vip_empty_rows``, the slot fallback)."""
    model = build(num_vip=8)
    tokens, _ = inputs(40, seed=3)
    imp = jnp.zeros((B, 40), bool).at[0, :12].set(True)  # row 0: 12 VIPs for 8 slots; row 1: none
    vs._warned.clear()
    with caplog.at_level("WARNING", logger="longctx.attention.vcc.stack"):
        for _ in range(2):
            _, aux = jax.block_until_ready(call(model, tokens, imp))
        jax.effects_barrier()
    assert int(aux["metrics"]["stack/vip_overflow"]) == 4 and int(aux["metrics"]["stack/vip_empty_rows"]) == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("VIP slots" in m and "num_vip=8" in m for m in msgs) == 1, caplog.text
    assert sum("hold no VIP token" in m for m in msgs) == 1, caplog.text


def test_lm_exploration_ranks_only_old_blocks():
    """An explored window refines min(h, old blocks) usable blocks: the random ranking covers the old blocks only
    (ranking all nbmax blocks then masking the young ones left h = 4 with ~0.25 / 1 / 3.75 usable blocks at
    4 / 16 / 60 old blocks of 64)."""
    nbmax, h = 64, 4
    ks = jax.random.split(jax.random.key(0), 2)
    anchors = jax.random.normal(ks[0], (8, 2, 4, 8))
    ck = jax.random.normal(ks[1], (8, 2, nbmax, 8))
    select = jax.jit(vs.lm_select, static_argnums=(4,), static_argnames=("explore_prob", "deterministic"))
    for nb_j in (2, 4, 16, 60):
        for seed in range(3):
            sel, _ = select(anchors, jnp.ones(4, bool), ck, nb_j, h, explore_prob=1.0, deterministic=False,
                            key=jax.random.key(seed))
            usable = [len(set(r) & set(range(nb_j))) for r in np.asarray(sel).tolist()]
            assert usable == [min(h, nb_j)] * 8, (nb_j, seed, usable)
