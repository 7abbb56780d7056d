#!/usr/bin/env python
from longctx.attention import eva
orig = eva.tile_groups
def apply():
    def tg(n_tiles, tile, P, C, causal, groups=8):
        out = orig(n_tiles, tile, P, C, causal, groups)
        return [(lo, hi, min(C, -(-nc // 16) * 16)) for lo, hi, nc in out]
    eva.tile_groups = tg
