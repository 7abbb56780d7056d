"""Per-device compiled memory and FLOPs of one train step with a row split over ``mesh.sequence``:
one device, then D devices with ``mesh.sequence_mode`` = xla and = compose (``longctx.train.dry_run.plan``;
compiled ahead of time, nothing runs). Usage, on simulated CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python scripts/sequence_memory.py \\
        --config configs/default.py --methods dense,transformer_vq,eva,fma --length 8192 --devices 8
"""

from __future__ import annotations

import argparse
import time

import jax

from longctx import attention
from longctx.bench.configs import load_config_file
from longctx.errors import ConfigError
from longctx.train import dry_run

MiB = 2**20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.py")
    ap.add_argument("--methods", default="", help="comma list (default: every registered causal method)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args(argv)
    if jax.device_count() < args.devices:
        raise SystemExit(f"{jax.device_count()} devices; set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{args.devices}")
    print("| method | temporaries, 1 device | xla | compose | GFLOP per device: 1 / xla / compose |")
    print("|---|---|---|---|---|")
    methods = args.methods.split(",") if args.methods else [
        m for m in attention.names() if attention.get_class(m).supports_causal]
    for method in methods:
        cells, flops = [], []
        for devices, mode in ((1, "xla"), (args.devices, "xla"), (args.devices, "compose")):
            c = load_config_file(args.config)
            c.model.vocab_size = c.model.vocab_size if c.model.vocab_size > 0 else 256
            c.model.attention.name = method
            allowed = attention.get_class(method).allowed_positions
            if allowed is not None and c.model.positions not in allowed:
                c.model.positions = allowed[0]
            c.train.seq_len, c.train.window, c.train.batch_size = args.length, 0, 1
            c.mesh.data, c.mesh.sequence, c.mesh.sequence_mode = 1, devices, mode
            t = time.time()
            try:
                r = dry_run.plan(c, jax.devices()[:devices])
            except ConfigError as e:  # a method whose cores do not compose: say why in the cell
                cells.append(f"refused ({e})")
                flops.append("-")
                continue
            cells.append(f"{r['temp_bytes'] / MiB:,.0f} MiB")
            flops.append(f"{r['flops_per_step'] / 1e9:.0f}")
            print(f"  {method} {devices} device(s) {mode}: compiled in {time.time() - t:.0f} s", flush=True)
        print(f"| {method} | {' | '.join(cells)} | {' / '.join(flops)} |", flush=True)


if __name__ == "__main__":
    main()
