"""`longctx-bench`: benchmark sub-commands, each writing <name>.json, <name>.md and PNG plots into --out.

    longctx-bench attention --out bench_out --methods dense,eva --lengths 1k,4k
    longctx-bench decode    --out bench_out --positions 1k,8k,32k
    longctx-bench quality   --out bench_out --lengths 1k,4k --workdir runs/bench_quality
    longctx-bench train     --out bench_out --steps 200
    longctx-bench step      --out bench_out --config configs/default.py --lengths 1k,4k,16k
    longctx-bench kernels   --out bench_out --lengths 8k,16k,32k   (Pallas kernels vs their XLA paths)
    longctx-bench profile   --out bench_out/profile --method eva --length 8k   (where one call's time goes)
    longctx-bench report    --out bench_out            (assembles BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit status 2 (as every longctx command)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from longctx.bench import (
        attention_bench,
        decode_bench,
        kernel_bench,
        profile_bench,
        quality_bench,
        report,
        step_bench,
        train_bench,
    )

    p = _Parser(prog="longctx-bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, mod, help_ in (
        ("attention", attention_bench, "forward / forward+backward time, memory, FLOP rate vs length"),
        ("decode", decode_bench, "per-token decoding latency and state size vs context position"),
        ("quality", quality_bench, "relative error against exact softmax attention"),
        ("train", train_bench, "training tokens/s, peak memory and validation bits/byte per method"),
        ("step", step_bench, "whole-model training step time of any config at given lengths (interleaved)"),
        ("kernels", kernel_bench, "each Pallas kernel against the XLA path it must match: time and differences"),
        ("profile", profile_bench, "one call of a core or a training step traced: time by XLA op, kind, source line"),
        ("report", report, "assemble BENCHMARKS.md from the JSON outputs"),
    ):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--out", default="bench_out", help="output folder (JSON, markdown, PNG)")
        if name != "report":
            sp.add_argument("--noprogress", "--no_progress", dest="progress", action="store_false",
                            help="no progress bar")
        mod.add_args(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv=None) -> int:
    from longctx.cli import user_errors
    from longctx.host_memory import keep_freed_memory, restart_with_huge_pages

    with user_errors():
        if argv is None:  # the console entry point: once, restart with glibc's huge-page tunable
            restart_with_huge_pages()
        keep_freed_memory()  # the same host allocation settings as the other entry points (longctx/host_memory.py)
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
