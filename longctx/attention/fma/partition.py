"""Checks of the partition (docs/methods/fma.md §2.2; tests/attention/test_fma.py): how often the sets
I_0..I_L cover each pair, and the level of every pair by the parity rule the blocked paths and the kernel use
(the definition is :func:`longctx.attention.fma.reference.level_matrix`)."""

from __future__ import annotations

import numpy as np

from pallas_kernels.fma_blocks_ref import level_partners


def cover_count(n: int, m: int, L: int, causal: bool, parent_condition: bool = True) -> np.ndarray:
    """How many of the sets I_0..I_L contain each pair. With ``parent_condition=False`` the sets are paper
    eq. (4) as printed ({D_l in {2, 3}}), which double-covers pairs."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    cnt = (np.abs(i // m - j // m) <= 1).astype(np.int32)
    for l in range(1, L + 1):
        ml = m << (l - 1)
        D_l = np.abs(i // ml - j // ml)
        s = (D_l >= 2) & (D_l <= 3)
        if parent_condition:
            s = s & (np.abs(i // (2 * ml) - j // (2 * ml)) <= 1)
        cnt = cnt + s
    if causal:
        cnt = np.where(j > i, 0, cnt)
    return cnt


def level_matrix_parity(n: int, m: int, L: int, causal: bool) -> np.ndarray:
    """lev[i, j] from the parity rule (the interaction list the blocked path and the kernel use)."""
    lev = np.full((n, n), -1, np.int32)
    i = np.arange(n)
    for qi in range(n):
        b = qi // m
        for bb in (b - 1, b) + (() if causal else (b + 1,)):
            if 0 <= bb:
                lo, hi = bb * m, min(n, (bb + 1) * m)
                lev[qi, lo:hi] = 0
        for l in range(1, L + 1):
            ml = m << (l - 1)
            N = -(-n // ml)
            g, valid = level_partners(np.asarray(qi // ml), causal, N)
            for gg, vv in zip(g, valid):
                if vv:
                    lev[qi, gg * ml:min(n, (gg + 1) * ml)] = l
    if causal:
        lev[i[None, :] > i[:, None]] = -1
    return lev


__all__ = ["cover_count", "level_matrix_parity"]
