"""B: EVA's causal tile groups set by env GROUPS (default 16) instead of min(32, max(8, n_tiles // 8))."""
import os


def apply():
    from longctx.attention import eva as E
    orig = E.tile_groups
    G = int(os.environ.get("GROUPS", "16"))
    E.tile_groups = lambda n_tiles, tile, P, C, causal, groups=8: orig(n_tiles, tile, P, C, causal, G)
