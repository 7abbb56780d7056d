"""One deterministic encoder forward at a long length, timed, with the process's peak memory: the
VCC encoder (configs/builtin/mlm_vcc.py's model, VCC settings of the paper's 128K run: 48 VIP
slots, blocks of 16, 90 fine blocks, 512-token segment-local first layer) or the dense encoder at
the same size. One (method, length) per process, so the peak resident memory is this run's.

    .venv/bin/python scripts/vcc_long_forward.py --method vcc --length 131072
    .venv/bin/python scripts/vcc_long_forward.py --method dense --length 16384
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
from flax import nnx

from longctx.config import load_sibling, resolve_vocab, validate
from longctx.models.decoder import build_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="vcc")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--vip", type=int, default=320, help="VIP (masked) positions per row")
    args = ap.parse_args()
    c = load_sibling(__file__, "../configs/builtin/mlm_" + args.method + ".py").get_config()
    c.train.seq_len = args.length
    c.mlm.rate = 0.01
    if args.method != "dense":
        v = c.model.attention[args.method]
        v.num_vip, v.block_size, v.num_fine_blocks, v.dense_segment_len, v.query_chunk = 48, 16, 90, 512, 1024
    else:
        c.model.attention.dense.impl = "blockwise"
    cfg = resolve_vocab(validate(c), 256)
    model = build_model(cfg.model, seed=0)
    gd, state = nnx.split(model)
    n = args.length
    tokens = jax.random.randint(jax.random.key(0), (1, n), 0, 256)
    important = jnp.zeros((1, n), bool).at[0, jax.random.choice(jax.random.key(1), n, (args.vip,), replace=False)].set(True)

    @jax.jit
    def fwd(state, tokens, important):
        h, _ = nnx.merge(gd, state).hidden(tokens, important)
        return h

    t0 = time.perf_counter()
    compiled = fwd.lower(state, tokens, important).compile()
    t1 = time.perf_counter()
    jax.block_until_ready(compiled(state, tokens, important))
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(state, tokens, important))
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{args.method} n={n}: compile {t1 - t0:.1f} s, first run {t2 - t1:.2f} s, second run {t3 - t2:.2f} s, "
          f"peak RSS {peak:.2f} GiB ({jax.devices()[0].platform})")


if __name__ == "__main__":
    main()
