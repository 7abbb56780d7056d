"""Sliding-window attention (the method ``swa``): exact softmax attention over the keys fewer than ``window``
positions away (Longformer's, Mistral's and Gemma's local attention; causal: the key itself and the ``window - 1``
before it; bidirectional: fewer than ``window`` positions away on either side), in training, evaluation and
decoding.

It is the dense core with a window (:class:`SlidingWindowAttention`, ``DenseAttention.window``): the same
implementations, the tiles skipping the key blocks wholly outside the window, cuDNN's and splash's own local masks,
a decoding state of the window's W keys whatever ``max_len``. It is a method of its own so that a
``model.attention.pattern`` can mix local and global layers (``pattern=swa,swa,swa,swa,swa,dense``:
five local layers, then one exact), and it is not ``exact``: past W tokens it is the baseline every efficient method
must beat, not the reference they are measured against.
"""

from __future__ import annotations

import ml_collections

from longctx.attention.base import ContractCase, require
from longctx.attention.dense.layer import DenseAttention


class SlidingWindowAttention(DenseAttention):
    exact = False
    sliding_window = True

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        cfg = super().default_config()
        # the keys a query sees: causal, itself and the window - 1 before it; bidirectional, those fewer than window
        # positions away on either side
        cfg.window = 512
        return cfg

    @classmethod
    def validate_config(cls, cfg, *, causal: bool) -> None:
        require(isinstance(cfg.window, int) and cfg.window >= 1,
                f"attention.swa.window={cfg.window!r}; must be a positive number of keys")
        super().validate_config(cfg, causal=causal)

    @classmethod
    def contract_cases(cls):
        tiles = {"impl": "blockwise", "block_q": 8, "block_k": 8, "window": 12}
        # a window of 12 keys over whole tiles of 8: blocks wholly inside it, its far edge and the diagonal;
        # decoding through the window's state
        return {
            "window": ContractCase(cfg=tiles, length=40, directions=("causal",)),
            "window_bidirectional": ContractCase(cfg=tiles, length=40, directions=("bidirectional",)),
        }

    @property
    def window(self) -> int:
        return int(self.cfg.window)


__all__ = ["SlidingWindowAttention"]
