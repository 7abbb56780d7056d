"""`longctx-bench`: benchmark sub-commands, each writing <name>.json, <name>.md and PNG plots into --out
(default ``bench_out`` under the working directory; ``scripts/bench_all.sh`` writes the published ones
into ``results/``).

    longctx-bench attention --methods dense,eva --lengths 1k,4k
    longctx-bench decode    --positions 1k,8k,32k
    longctx-bench quality   --lengths 1k,4k --workdir runs/bench_quality
    longctx-bench train     --steps 200 --config.train.seq_len=512
    longctx-bench step      --config configs/default.py --lengths 1k,4k,16k --config.model.d_model=512
    longctx-bench kernels   --lengths 8k,16k,32k   (Pallas kernels vs their XLA paths)
    longctx-bench sweep     --length 32k   (each kernel's tiles / warps / stages tried; the fastest proposed)
    longctx-bench profile   --method eva --length 8k   (where one call's time goes)
    longctx-bench ab        TREE_A TREE_B --method eva --length 8k   (two source trees, interleaved)
    longctx-bench dropin    --workdir runs/llama_tiny --method kdeformer   (a trained model's layers swapped)
    longctx-bench compare   --plan   (every causal method at equal training FLOPs; resumable; results/compare)
    longctx-bench report    --out results --output BENCHMARKS.md   (assembles BENCHMARKS.md)

Config overrides take the form of the other entry points: ``--config.KEY=VALUE`` (quality: of its tiny
dense run; train: of every method's config; step and profile: of ``--config``). The flags are absl flags,
as those of every other longctx command: ``--name value`` or ``--name=value``, a boolean ``--name`` or
``--noname`` (e.g. ``--noprogress``, ``--noisolate``).
Every bad input is answered with one line starting with ``error:`` and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

from absl import flags

from longctx import attention
from longctx.bench import (
    ab_bench,
    attention_bench,
    compare,
    configs,
    decode_bench,
    dropin,
    kernel_bench,
    profile_bench,
    quality_bench,
    report,
    step_bench,
    sweep_bench,
    train_bench,
)
from longctx.bench import common as C
from longctx.bench.cores import variants
from longctx.cli import flag_help, user_errors
from longctx.errors import ConfigError
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages

# sub-commands whose config takes --config.KEY=VALUE overrides
TAKES_OVERRIDES = ("quality", "train", "step", "profile", "ab", "dropin", "compare")


PROG = "longctx-bench"
_HELP = ("-h", "--help", "--helpshort", "--helpfull")


def _modules():
    return (
        ("attention", attention_bench, "forward / forward+backward time, memory, FLOP rate vs length"),
        ("decode", decode_bench, "per-token decoding latency and state size vs context position"),
        ("quality", quality_bench, "relative error against exact softmax attention"),
        ("train", train_bench, "training tokens/s, peak memory and validation bits/byte per method"),
        ("step", step_bench, "whole-model training step time of any config at given lengths (interleaved)"),
        ("kernels", kernel_bench, "each Pallas kernel against the XLA path it must match: time and differences"),
        ("sweep", sweep_bench, "each Pallas kernel's knobs tried on this device; the fastest proposed as its default"),
        ("profile", profile_bench, "one call of a core or a training step traced: time by XLA op, kind, source line"),
        ("ab", ab_bench, "one core or training step of two source trees, calls alternated, medians"),
        ("dropin", dropin, "a method in every layer of a trained exact model, no training: per-layer error, bits/byte"),
        ("compare", compare, "every causal method at equal training FLOPs, contexts and seeds: bits/byte, recall, cost"),
        ("report", report, "assemble BENCHMARKS.md from the JSON in results/"),
    )


def _usage_error(message: str, prog: str = PROG) -> NoReturn:
    """A command line that does not parse: one line on stderr, exit status 2 (as every longctx command)."""
    print(f"error: {message}; see {prog} --help", file=sys.stderr)
    raise SystemExit(2)


class Parser:
    """``longctx-bench SUBCOMMAND [flags] [ARGS]``, parsed with absl flags: each sub-command's flags live in a
    ``FlagValues`` of their own, defined by its module's ``define_flags(fv)`` (beside ``--out`` and
    ``--[no]progress``, common to all but report). A module may name ``POSITIONALS`` (taken, in order, from what
    is left of the command line after the flags) and ``REQUIRED`` flags.
    ``--config.KEY=VALUE`` overrides are taken out of the command line before (:func:`split_overrides`)."""

    def __init__(self):
        self.commands = {name: (mod, help_) for name, mod, help_ in _modules()}

    def flag_values(self, command: str) -> flags.FlagValues:
        mod, _ = self.commands[command]
        fv = flags.FlagValues()
        mod.define_flags(fv)
        if "out" not in fv:
            flags.DEFINE_string("out", "bench_out", "output folder (JSON, markdown, PNG), relative to the working "
                                "directory", flag_values=fv)
        if command != "report":
            flags.DEFINE_bool("progress", True, "show the progress bar (--noprogress hides it)",
                              flag_values=fv)
        return fv

    def format_help(self, command: str | None = None) -> str:
        if command is None:
            width = max(map(len, self.commands))
            return "\n".join([f"usage: {PROG} COMMAND [flags]", "", __doc__.split("\n\n")[0], "", "commands:",
                              *(f"  {n:<{width}}  {h}" for n, (_, h) in self.commands.items()), "",
                              "overrides: --config.KEY=VALUE (e.g. --config.model.d_model=128) for "
                              + ", ".join(TAKES_OVERRIDES) + f"; see {PROG} COMMAND --help"])
        mod, help_ = self.commands[command]
        fv = self.flag_values(command)
        positionals = getattr(mod, "POSITIONALS", ())
        out = [f"usage: {PROG} {command} " + "".join(f"{n.upper()} " for n, _ in positionals) + "[flags]", "",
               (mod.__doc__ or help_).strip().split("\n\n")[0], ""]
        if command in TAKES_OVERRIDES:
            out += ["config overrides: --config.KEY=VALUE, repeatable (e.g. --config.model.d_model=128)", ""]
        if positionals:
            out += ["arguments:", *(f"  {n.upper()}: {h}" for n, h in positionals), ""]
        out += ["flags:", *flag_help(fv, sorted(fv))]
        return "\n".join(out)

    def parse_args(self, argv: list[str]) -> SimpleNamespace:
        """The flags and arguments of one sub-command (no value checked beyond its type); a command line that
        does not parse is one ``error:`` line and SystemExit(2); ``--help`` prints the help and exits."""
        argv = list(argv)
        if argv and argv[0] in _HELP:
            print(self.format_help())
            raise SystemExit(0)
        if not argv or argv[0].startswith("-"):
            _usage_error(f"{PROG}: the following arguments are required: command")
        if argv[0] not in self.commands:
            _usage_error(f"{PROG}: argument command: invalid choice: {argv[0]!r} (choose from "
                         + ", ".join(repr(n) for n in self.commands) + ")")
        command, rest = argv[0], argv[1:]
        prog = f"{PROG} {command}"
        if any(a in _HELP for a in rest):
            print(self.format_help(command))
            raise SystemExit(0)
        mod, _ = self.commands[command]
        fv = self.flag_values(command)
        try:
            left = fv([prog, *rest])[1:]
        except flags.UnrecognizedFlagError as e:
            import difflib

            close = difflib.get_close_matches(e.flagname, list(fv), n=1)
            _usage_error(f"{PROG}: unrecognized arguments: --{e.flagname}"
                         + (f" (did you mean --{close[0]}?)" if close else ""))
        except flags.Error as e:
            _usage_error(f"{prog}: {' '.join(str(e).split())}", prog)
        names = [n for n, _ in getattr(mod, "POSITIONALS", ())]
        if len(left) > len(names):
            _usage_error(f"{PROG}: unrecognized arguments: {' '.join(left[len(names):])}")
        missing = names[len(left):] + [f"--{n}" for n in getattr(mod, "REQUIRED", ()) if fv[n].value is None]
        if missing:
            _usage_error(f"{prog}: the following arguments are required: {', '.join(missing)}", prog)
        return SimpleNamespace(command=command, **dict(zip(names, left)), **{n: fv[n].value for n in fv},
                               func=mod.run, validate=getattr(mod, "validate", None))


def build_parser() -> Parser:
    return Parser()


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``KEY=VALUE`` of every ``--config.KEY=VALUE`` or ``--config.KEY VALUE``, the other arguments)."""
    overrides, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--config."):
            key, eq, value = a[len("--config."):].partition("=")
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{a} needs a value: {a}=VALUE")
                value, i = argv[i + 1], i + 1
            if not key:
                raise ConfigError(f"{a}: give a key, e.g. --config.model.d_model=128")
            overrides.append(f"{key}={value}")
        else:
            rest.append(a)
        i += 1
    return overrides, rest


def _lengths(args, name: str, *, one: bool = False) -> None:
    text = getattr(args, name, None)
    if text is None:
        return
    flag = f"--{name}"
    try:
        values = C.parse_ints(text)
    except (ValueError, OverflowError):
        values = None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{flag} {text!r}: expected "
                          + ("a positive length such as 8k or 8192" if one else
                             "a comma list of positive lengths such as 1k,4k,8192") + " (k = 1024)")
    if one and len(values) != 1:
        raise ConfigError(f"{flag} {text!r}: give one length, e.g. {flag} 8k")


def _at_least(args, low, *names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and not (v >= low):  # NaN fails too
            raise ConfigError(f"--{n} {v!r}: must be {'>= ' + str(low) if low != 1 else 'a positive integer'}")


def _positive(args, *names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and not (v > 0):
            raise ConfigError(f"--{n} {v!r}: must be a positive number")


def _methods(args, extra=()) -> None:
    names = C.parse_names(getattr(args, "methods", None))
    registered = list(attention.names())
    for req in names or ():
        if req in extra:
            continue
        base = req.split(":")[0]
        if base not in registered:
            raise ConfigError(f"--methods: unknown method {base!r}; registered: {', '.join(registered + list(extra))}")
        if ":" in req and req not in (label for label, _ in variants(base)):
            raise ConfigError(f"--methods: {req!r} is not a variant of {base}; it offers "
                              f"{', '.join(label for label, _ in variants(base))}")


def validate(args) -> None:
    """Every check that needs no computation, so that a bad flag fails before anything runs."""

    cmd = args.command
    out = Path(args.out)
    if cmd == "report":
        if not out.is_dir():
            raise ConfigError(f"--out {args.out}: not a folder of benchmark results (e.g. --out results)")
    elif out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out}: exists and is not a folder")
    for name in ("lengths", "positions"):
        if cmd not in ("profile", "ab"):
            _lengths(args, name)
    _at_least(args, 1, "repeats", "batch", "heads", "head_dim", "seeds", "calls", "prefill_chunk",
              "eval_tokens", "train_steps", "top", "reps", "max_settings")
    _at_least(args, 0, "warmup", "seed", "layer", "matmul_n", "window", "seq_len", "d_model", "num_layers",
              "calls_per_sample")
    _positive(args, "peak_tflops")
    _positive(args, "mem_budget_gb", "max_cell_s", "max_prefill_s", "budget")
    if cmd in ("decode", "train"):
        _at_least(args, 1, "steps")
    if cmd == "step":
        _at_least(args, 1, "batch_size", "vocab_size")
    elif cmd == "train":
        _at_least(args, 0, "batch_size")
    if cmd in ("attention", "decode", "quality", "train", "kernels", "sweep"):
        _methods(args, extra=("torch_sdpa",) if cmd == "attention" else ())
    if cmd == "quality":
        bad = [s for s in (args.sources or "").split(",") if s.strip() not in ("gaussian", "captured")]
        if bad or not args.sources:
            raise ConfigError(f"--sources {args.sources!r}: give gaussian and/or captured, e.g. --sources gaussian")
    if cmd in ("profile", "ab", "sweep"):
        _lengths(args, "length", one=True)
    if cmd in ("profile", "ab"):
        if bool(args.method) == bool(args.config):
            raise ConfigError(f"longctx-bench {cmd}: give exactly one of --method (an attention core) or --config "
                              "(a training step)")
    if cmd in ("step", "profile", "ab") and getattr(args, "config", None):
        if configs.find_config(args.config) is None and args.config != configs.DEFAULT:
            raise ConfigError(f"--config {args.config}: no such config file")
    if cmd in TAKES_OVERRIDES:
        configs.check_overrides(args.overrides)
    if args.validate is not None:  # the sub-command's own checks
        args.validate(args)


def parse_args(argv: list[str]) -> SimpleNamespace:
    """Parse and check ``longctx-bench`` arguments (program name not included) without running anything:
    bad flags raise SystemExit(2) (one ``error:`` line on stderr), bad values raise ConfigError."""
    overrides, rest = split_overrides(list(argv))
    args = build_parser().parse_args(rest)
    if overrides and args.command not in TAKES_OVERRIDES:
        raise ConfigError(f"longctx-bench {args.command} takes no --config.KEY=VALUE overrides "
                          f"(they apply to {', '.join(TAKES_OVERRIDES)})")
    args.overrides = overrides
    validate(args)
    return args


def main(argv=None) -> int:
    with user_errors():
        if argv is None:  # the console entry point: once, restart with glibc's huge-page tunable
            restart_with_huge_pages()
        keep_freed_memory()  # the same host allocation settings as the other entry points (longctx/host_memory.py)
        args = parse_args(sys.argv[1:] if argv is None else argv)
        args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
