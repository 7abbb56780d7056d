"""Command-line entry points, all in one style (absl flags + ml_collections ``config_flags``).

    longctx-train   --config=configs/default.py --config.train.steps=1000 --workdir=runs/mine
    longctx-prepare --config=configs/enwik8/dense.py:tiny --config.data.path=/data/enwik8.zip
    longctx-eval    --workdir=runs/mine --split=test --config.eval.protocol=sliding
    longctx-sample  --workdir=runs/mine --prompt="def " --num_tokens=400 [--config.sample.top_k=40]
    longctx-fill    --workdir=runs/mlm --text="def f(x):\\n    return ____"   (encoder runs)
    longctx-recall  --workdir=runs/recall/dense [--task=passkey --length=1024]   (recall by distance)
    longctx-recall-report --runs=runs/recall/dense,runs/recall/eva --out=bench_out/recall

``train`` and ``prepare`` read a config file (``--config=FILE[:VARIANT]``, found from any working
directory as :mod:`longctx.config_files` describes, then ``--config.KEY=VALUE`` overrides);
``eval``, ``sample`` and ``recall`` read the config saved with the run's checkpoint and take
``--config.eval.*``, ``--config.sample.*``, ``--config.data.path`` and ``--config.data.cache_dir``
overrides of it (the short flags ``--split``, ``--prompt``, ``--num_tokens``, ``--temperature``,
``--top_k``, ``--top_p`` and ``--seed`` are the same overrides). Every command takes
``--noprogress`` and ``--check`` (parse the flags, load and validate the config and overrides, then
stop without running). Each entry point parses its flags and calls one function; a user error is
one line on stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import sys

from longctx import config_files
from longctx.errors import ConfigError, DataError, LongctxError, capacity_message
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages


def _quiet_closed_event_loop(hook):
    """After a failed read, Orbax's async machinery can fire callbacks on its closed event loop at
    exit; Python then prints 'Exception ignored ... Event loop is closed' tracebacks. Drop only those."""

    def quiet(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        hook(unraisable)

    return quiet


@contextlib.contextmanager
def user_errors():
    """Turn framework errors into one line on stderr and exit status 2."""
    if not getattr(sys.unraisablehook, "_longctx", False):
        sys.unraisablehook = _quiet_closed_event_loop(sys.unraisablehook)
        sys.unraisablehook._longctx = True
    try:
        yield
    except LongctxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C outside the trainer's own handler (which checkpoints): no traceback
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:  # a state given more than it holds: one line, also from inside a compiled program
        msg = capacity_message(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


def join_config_flag(argv: list[str]) -> list[str]:
    """``--config FILE`` -> ``--config=FILE`` (config_flags needs the file before the overrides)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            out.append(f"--config={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _flag_names(fv) -> str:
    names = sorted(n for n in fv if not n.startswith("config.") and n not in ("config", *_HIDDEN))
    return ", ".join(f"--{n}" for n in names)


# what each command does and how it is called, for --help
ABOUT = {
    "longctx-train": ("--config=FILE[:VARIANT] [--config.KEY=VALUE ...] --workdir=DIR [flags]",
                      "Train a model from a config file; resumes when DIR holds checkpoints."),
    "longctx-prepare": ("--config=FILE[:VARIANT] [--config.KEY=VALUE ...] [flags]",
                        "Tokenize every split of the config's dataset once, into the cache (data.cache_dir)."),
    "longctx-eval": ("--workdir=DIR [--split=test] [--config.eval.KEY=VALUE ...] [flags]",
                     "Score a trained run on a split; writes WORKDIR/eval/<split>_step<N>_<protocol>.json and a plot."),
    "longctx-sample": ("--workdir=DIR [--prompt=TEXT] [--num_tokens=N] [--config.sample.KEY=VALUE ...] [flags]",
                       "Sample text from a trained decoder with stateful decoding."),
    "longctx-fill": ("--workdir=DIR --text=TEXT [flags]",
                     "Fill the masked bytes of a text with a trained encoder (masked LM)."),
    "longctx-recall": ("--workdir=DIR [--task=passkey] [--length=N] [--config.KEY=VALUE ...] [flags]",
                       "Recall accuracy and answer loss by distance on a generated task."),
    "longctx-recall-report": ("--runs=DIR,DIR,... [--out=DIR] [flags]",
                              "One markdown table and one plot from several runs' recall results."),
}
_HIDDEN = ("help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok")


def help_text(prog: str, fv, config: str) -> str:
    """A short ``--help``: usage, what the command does, the config and override syntax, where
    configs live, and the command's own flags (never the flattened config)."""
    usage, about = ABOUT.get(prog, ("[flags]", ""))
    out = [f"usage: {prog} {usage}", ""]
    if about:
        out += [about, ""]
    if config == "file":
        out += [f"Config: --config=FILE or FILE:VARIANT (default {config_files.DEFAULT}). A relative FILE that "
                "does not exist",
                f"in the working directory is read from the project's configs ({config_files.CONFIG_DIR}).",
                "Change any key with --config.KEY=VALUE, e.g. --config.train.steps=1000 "
                "--config.model.attention.name=eva",
                "(keys and defaults: longctx/config.py); a hybrid stack, one method per layer, repeated to the depth:",
                "--config.model.attention.pattern=dense,eva,eva,eva. Shipped configs, [:VARIANT] where a file has "
                "variants:"]
    elif prog in ("longctx-fill", "longctx-recall-report"):
        out += ["Config: the run's own, saved in WORKDIR/config.json when it trained; this command takes no",
                "--config.KEY=VALUE overrides. Runs are trained with longctx-train from these configs:"]
    else:
        out += ["Config: the run's own, saved in WORKDIR/config.json when it trained. Change what this command",
                "reads with --config.KEY=VALUE for KEY in eval.*, sample.*, data.path, data.cache_dir,",
                "model.scan_layers, <fma|fma_linear>.allow_truncated_window, and between dense and swa",
                "model.attention.name and model.attention.swa.window, e.g. --config.eval.protocol=sliding",
                "--config.eval.context=512. Runs are trained with longctx-train from these configs:"]
    out += [config_files.listing(), "", "flags:"]
    out += flag_help(fv, sorted(n for n in fv if not n.startswith("config") and n not in _HIDDEN))
    return "\n".join(out)


def flag_help(fv, names) -> list[str]:
    """One wrapped ``--name: help (default: ...)`` entry per flag of ``names`` (``--[no]name`` for booleans)."""
    import textwrap

    out = []
    for name in names:
        f = fv[name]
        if f.boolean:
            head = f"  --[no]{name}"
            default = f" (default: {'true' if f.default else 'false'})"
        else:
            head = f"  --{name}"
            default = f" (default: {f.default!r})" if f.default not in (None, "", []) else ""
        out.append(textwrap.fill(f"{head}: {f.help}{default}", width=100, subsequent_indent=" " * 6))
    return out


class _ConfigLoadError(Exception):
    """A config file that cannot be loaded (carried past absl's flag parsing, which rewrites ValueErrors)."""


def _config_file_flag(fv, argv):
    """``--config=FILE[:VARIANT]``: ml_collections' config-file flag (``--config.KEY=VALUE``
    overrides, locked), loading through :func:`longctx.config_files.load`."""
    from absl import flags
    from ml_collections.config_flags import config_flags  # the module: its flag classes are not re-exported

    class Parser(config_flags.ConfigFileFlagParser):
        def parse(self, path):
            try:
                cfg = config_files.load(path)
            except ConfigError as e:
                raise _ConfigLoadError(str(e)) from None
            cfg.lock()
            return cfg

    flag = config_flags._ConfigFlag(parser=Parser(name="config"), serializer=flags.ArgumentSerializer(),
                                    name="config", default=config_files.DEFAULT, flag_values=fv, sys_argv=argv,
                                    help_string="config file FILE[:VARIANT]")
    flags.DEFINE_flag(flag, fv)


def parse(argv, prog: str, *, config: str, define=None, require_workdir: bool = True):
    """Parse ``argv`` (``sys.argv`` layout, program name first) for ``prog``.

    ``config='file'``: ``--config=FILE[:VARIANT]`` (default ``configs/default.py``) and its
    overrides; returns (flags, config). ``config='run'``: overrides of a trained run's saved config;
    returns (flags, {dotted key: value}). ``define(fv)`` adds the command's own flags.
    ``--workdir``, ``--[no]progress`` and ``--[no]check`` are common to all."""
    try:
        return _parse(argv, prog, config=config, define=define, require_workdir=require_workdir)
    except _ConfigLoadError as e:
        raise ConfigError(str(e)) from None


def _parse(argv, prog: str, *, config: str, define=None, require_workdir: bool = True):
    from absl import flags
    from ml_collections import config_flags

    from longctx import config as config_lib  # deferred: CLI start-up: no jax at import

    if argv is None:  # a console entry point: once, restart with glibc's huge-page tunable (host_memory.py)
        restart_with_huge_pages()
    keep_freed_memory()  # before JAX starts its threads (see longctx/host_memory.py)
    argv = join_config_flag(list(sys.argv if argv is None else argv))
    fv = flags.FlagValues()
    if config == "file":
        # sys_argv: config_flags finds the --config.* overrides in it (by default it reads sys.argv)
        _config_file_flag(fv, argv)
    else:
        if any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
            raise ConfigError(f"{prog} reads the config saved in --workdir; change it with --config.KEY=VALUE")
        try:  # the --config.* overrides are parsed here, against the base config
            config_flags.DEFINE_config_dict("config", config_lib.base_config(), "overrides of the run's saved config",
                                            flag_values=fv, lock_config=True, sys_argv=argv)
        except (AttributeError, KeyError) as e:
            raise ConfigError(_unknown_key_message(e, argv, fv, prog)) from None
    flags.DEFINE_string("workdir", None, "run directory (checkpoints, logs, plots)", flag_values=fv)
    flags.DEFINE_bool("progress", True, "show progress bars (--noprogress hides them; log lines are still "
                      "printed)", flag_values=fv)
    flags.DEFINE_bool("check", False, "parse the flags, load and validate the config and its overrides, print "
                      "what would run, and stop", flag_values=fv)
    if define is not None:
        define(fv)
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
        print(help_text(prog, fv, config))
        raise SystemExit(0)
    try:
        rest = fv(argv)
        cfg = fv.config
        cfg.keys()  # a config file that failed to load raises here
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(_unknown_flag_message(e, argv, fv, prog)) from None
    except flags.IllegalFlagValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    except (AttributeError, KeyError) as e:
        raise ConfigError(_unknown_key_message(e, argv, fv, prog)) from None
    except (OSError, ImportError, SyntaxError) as e:
        first = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ConfigError(f"cannot load the config file: {' '.join(first[-2:])}") from None
    except flags.Error as e:
        raise ConfigError(" ".join(str(e).split())) from None
    if len(rest) > 1:
        raise ConfigError(f"{prog}: unexpected argument {rest[1]!r}; flags look like --name=value ({_flag_names(fv)})")
    if require_workdir and not fv.workdir:
        raise ConfigError("--workdir is required (where checkpoints, logs and plots go), e.g. --workdir runs/default")
    over = dict(config_flags.get_override_values(fv["config"]))
    if config == "file":
        for key, value in config_lib.one_budget(over).items():  # a budget given alone replaces the file's other
            if key not in over:
                section, name = key.split(".")
                cfg[section][name] = value
        return fv, cfg
    return fv, over


def _unknown_key_message(e: Exception, argv, fv, prog) -> str:
    """The line for a ``--config.KEY`` the config has no key or section for (ml_collections raises AttributeError
    or KeyError)."""
    import re

    from absl import flags

    m = re.search(r"'(\w+)'", str(e).replace("\\'", "'"))
    flag = next((a[2:].split("=", 1)[0] for a in argv if m and a.startswith("--config.")
                 and m.group(1) in a.split("=", 1)[0].split(".")[1:]), None)
    if flag:
        return _unknown_flag_message(flags.UnrecognizedFlagError(flag), argv, fv, prog)
    msg = " ".join(str(e).replace("\\'", "'").strip("'\"").split())
    return f"unknown config key: {msg}"


def _unknown_flag_message(err, argv, fv, prog) -> str:
    import difflib

    name = getattr(err, "flagname", "") or str(err)
    if not name.startswith("config."):
        close = difflib.get_close_matches(name, [n for n in fv if not n.startswith("config.")], n=1)
        hint = f" (did you mean --{close[0]}?)" if close else ""
        return f"{prog}: unknown flag --{name}{hint}; allowed: {_flag_names(fv)}, --config.<key>=<value>"
    parts = name.split(".")[1:]
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    try:
        if path is None:
            from longctx.config import base_config  # deferred: CLI start-up: no jax at import

            node = base_config()
        else:
            node = config_files.load(path)
        depth = 0
        for p in parts[:-1]:  # the first part the config lacks: a section higher up, or the key itself
            if p not in node.keys():
                break
            node, depth = node[p], depth + 1
        keys = sorted(node.keys())
    except Exception:  # noqa: BLE001 -- the key path itself is wrong higher up
        return f"unknown config key {'.'.join(parts)!r}"
    close = difflib.get_close_matches(parts[depth], keys, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if depth < len(parts) - 1:
        where = f" in {'.'.join(parts[:depth])}" if depth else ""
        return (f"unknown config key {'.'.join(parts)!r}: no section {parts[depth]!r}{where}{hint}; sections and "
                f"keys there: {', '.join(keys)}")
    return f"unknown config key {'.'.join(parts)!r}{hint}; allowed keys there: {', '.join(keys)}"


def _run_flag(fv, overrides: dict, flag: str, key: str) -> None:
    """A short flag (``--temperature``) is the override ``--config.sample.temperature``."""
    value = fv[flag].value
    if value is not None:
        if key in overrides and overrides[key] != value:
            raise ConfigError(f"--{flag}={value} and --config.{key}={overrides[key]} disagree; give one of them")
        overrides[key] = value


def _check_run(prog: str, fv, overrides: dict) -> int:
    """``--check`` of a command that reads a trained run: the overrides name keys it may change (their types were
    checked by the flag parser), the run exists and its saved config with them validates (``runtime.check_run``);
    its checkpoint is not restored."""
    from longctx.runtime import check_run  # deferred: CLI start-up: no jax at import

    checked = check_run(fv.workdir, overrides)
    shown = " ".join(f"{k}={v}" for k, v in overrides.items())
    print(f"ok: {prog} would read the run in {fv.workdir}" + (f" with {shown}" if shown else "")
          + f"; checked: {checked}")
    return 0


# ----------------------------------------------------------------------------------------------
# entry points


def train_main(argv=None) -> int:
    """``longctx-train``: validate the config, train (resuming if the workdir holds checkpoints)."""
    from absl import flags

    def define(fv):
        flags.DEFINE_integer("max_steps", None, "stop after this many steps in this invocation", flag_values=fv)
        flags.DEFINE_bool("dry_run", False, "compile the train step for the configured mesh and print per-device "
                          "memory and FLOPs; touches no data and writes nothing", flag_values=fv)

    with user_errors():
        fv, cfg = parse(argv, "longctx-train", config="file", define=define, require_workdir=False)
        asked = [a for a in (sys.argv if argv is None else argv)[1:] if a.split("=")[0] == "--config.model.causal"]
        if asked and cfg.model.kind == "encoder" and cfg.model.causal:  # an encoder's blocks are bidirectional
            raise ConfigError(f"{asked[-1]}: model.kind='encoder' trains bidirectional blocks (model.causal is False "
                              "for it); drop the flag, or train a causal LM with --config.model.kind=decoder")
        if not fv.dry_run and not fv.workdir:
            raise ConfigError("--workdir is required (where checkpoints, logs and plots go), e.g. --workdir runs/default")
        if fv.max_steps is not None and fv.max_steps <= 0:
            raise ConfigError(f"--max_steps={fv.max_steps} must be a positive integer")
        if fv.check:
            import jax  # deferred: CLI start-up: no jax at import

            from longctx import attention  # deferred: CLI start-up: no jax at import
            from longctx import config as config_lib  # deferred: CLI start-up: no jax at import
            from longctx.attention import dispatch  # deferred: CLI start-up: no jax at import
            from longctx.data import sources  # deferred: CLI start-up: no jax at import
            from longctx.train import sharding  # deferred: CLI start-up: no jax at import

            c = config_lib.validate(cfg)
            attention.check_execution(c, dispatch.current_platform())
            sharding.check_layout(c, jax.device_count(), here=False)
            elsewhere = ""
            try:  # a config for another machine's devices is checked, not refused
                sharding.mesh_shape(c.mesh, jax.device_count())
            except ConfigError as e:
                print(f"warning: {e} (here)", file=sys.stderr)
                elsewhere = f"; not on this machine's {jax.device_count()} device(s): the mesh above"
            try:  # whether the data is where the config says (not read): a missing corpus is said, not refused
                sources.build(c.data)
            except DataError as e:
                print(f"warning: the data is not there yet: {e}", file=sys.stderr)
            where = f" ({c.data.path})" if c.data.path and not sources.is_generated(c.data.source) else ""
            print(f"ok: longctx-train would train {c.train.steps} steps of {'an' if c.model.kind[0] in 'aeiou' else 'a'} "
                  f"{c.model.kind} with "
                  f"attention={config_lib.attention_label(c.model)} on data.source={c.data.source!r}{where}"
                  + (f", writing to {fv.workdir}" if fv.workdir else "") + (" (dry run)" if fv.dry_run else "")
                  + elsewhere)
            return 0
        if fv.dry_run:
            from longctx.train import dry_run  # deferred: CLI start-up: no jax at import

            print(dry_run.report(dry_run.plan(cfg)))
            return 0
        from longctx.train.loop import train  # deferred: CLI start-up: no jax at import

        try:
            summary = train(cfg, fv.workdir, progress=fv.progress, max_steps=fv.max_steps)
        except KeyboardInterrupt:  # a second Ctrl-C: leave at once, without the background writers' noise
            import os

            print("error: interrupted twice: stopped at once without a new checkpoint; run the same command to "
                  "resume from the last one", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)
        valid = summary["last_valid_bits_per_token"]
        print(f"done: step {summary['step']}, " + (f"last valid bits/token {valid}" if valid is not None
                                                    else "no validation recorded"))
    return 0


def prepare_main(argv=None) -> int:
    """``longctx-prepare``: tokenize every split of the config's data source once."""
    with user_errors():
        fv, cfg = parse(argv, "longctx-prepare", config="file", require_workdir=False)
        if fv.check:
            from longctx import config as config_lib  # deferred: CLI start-up: no jax at import

            c = config_lib.validate(cfg)
            print(f"ok: longctx-prepare would tokenize {c.data.source} with the {c.data.tokenizer} tokenizer")
            return 0
        from longctx.data.prepare_cli import prepare_all  # deferred: CLI start-up: no jax at import

        prepare_all(cfg, progress=fv.progress)
    return 0


def eval_main(argv=None) -> int:
    """``longctx-eval``: score a trained run on a split."""
    from absl import flags

    def define(fv):
        flags.DEFINE_enum("split", None, ["train", "valid", "test"], "split to score (= --config.eval.split)",
                          flag_values=fv)
        flags.DEFINE_integer("step", None, "checkpoint step (default: the newest valid one)", flag_values=fv)

    with user_errors():
        fv, overrides = parse(argv, "longctx-eval", config="run", define=define)
        _run_flag(fv, overrides, "split", "eval.split")
        if fv.check:
            return _check_run("longctx-eval", fv, overrides)
        from longctx.evaluate import evaluate_run  # deferred: CLI start-up: no jax at import

        evaluate_run(fv.workdir, step=fv.step, overrides=overrides, progress=fv.progress)
    return 0


def sample_main(argv=None) -> int:
    """``longctx-sample``: sample text from a trained run with stateful decoding."""
    from absl import flags

    short = {"prompt": "sample.prompt", "num_tokens": "sample.num_tokens", "temperature": "sample.temperature",
             "top_k": "sample.top_k", "top_p": "sample.top_p", "seed": "sample.seed"}

    def define(fv):
        flags.DEFINE_integer("step", None, "checkpoint step (default: the newest valid one)", flag_values=fv)
        flags.DEFINE_string("prompt", None, "prompt text (= --config.sample.prompt)", flag_values=fv)
        flags.DEFINE_string("prompt_file", None, "read the prompt from this UTF-8 file", flag_values=fv)
        flags.DEFINE_integer("num_tokens", None, "tokens to generate, > 0 (= --config.sample.num_tokens)",
                             flag_values=fv)
        flags.DEFINE_float("temperature", None, "sampling temperature, >= 0; 0 = greedy", flag_values=fv)
        flags.DEFINE_integer("top_k", None, "keep the k most likely tokens, >= 0; 0 = all", flag_values=fv)
        flags.DEFINE_float("top_p", None, "nucleus mass, in (0, 1]", flag_values=fv)
        flags.DEFINE_integer("seed", None, "sampling seed", flag_values=fv)
        flags.DEFINE_string("output", None, "file for the sample (must not exist; default: WORKDIR/samples/...)",
                            flag_values=fv)
        flags.DEFINE_bool("quiet", False, "do not stream the text", flag_values=fv)

    with user_errors():
        fv, overrides = parse(argv, "longctx-sample", config="run", define=define)
        for flag, key in short.items():
            _run_flag(fv, overrides, flag, key)
        if fv.prompt is not None and fv.prompt_file is not None:
            raise ConfigError("give --prompt or --prompt_file, not both")
        if fv.check:
            return _check_run("longctx-sample", fv, overrides)
        from longctx.sample import sample_run  # deferred: CLI start-up: no jax at import

        sample_run(fv.workdir, step=fv.step, overrides=overrides, prompt_file=fv.prompt_file, output=fv.output,
                   quiet=fv.quiet, progress=fv.progress)
    return 0


def fill_main(argv=None) -> int:
    """``longctx-fill``: fill the masked bytes of a text with a trained encoder (masked LM)."""
    from absl import flags

    def define(fv):
        flags.DEFINE_integer("step", None, "checkpoint step (default: the newest valid one)", flag_values=fv)
        flags.DEFINE_string("text", None, "text whose --mask_char bytes are filled (\\n, \\t, \\\\ are escapes)",
                            flag_values=fv)
        flags.DEFINE_string("text_file", None, "read the text from this UTF-8 file", flag_values=fv)
        flags.DEFINE_string("mask_char", "_", "the character that marks a masked byte", flag_values=fv)
        flags.DEFINE_string("mask_spans", None, "mask these byte ranges instead, e.g. 4:8,12:15 (end excluded)",
                            flag_values=fv)
        flags.DEFINE_integer("per_pass", 1, "masked bytes filled per forward pass (most confident first)",
                             flag_values=fv)
        flags.DEFINE_bool("escapes", True, "read \\n, \\t and \\\\ in --text as escapes", flag_values=fv)

    with user_errors():
        fv, overrides = parse(argv, "longctx-fill", config="run", define=define)
        if overrides:
            raise ConfigError("longctx-fill takes no --config.* overrides; it uses the run's saved config")
        if (fv.text is None) == (fv.text_file is None):
            raise ConfigError("give the text to fill with --text or --text_file (one of them)")
        if fv.check:
            return _check_run("longctx-fill", fv, overrides)
        if fv.text_file is not None:
            try:
                text = open(fv.text_file, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--text_file={fv.text_file}: cannot read it as UTF-8 text ({e})") from None
        else:
            text = fv.text
        from longctx.fill import fill_run  # deferred: CLI start-up: no jax at import

        fill_run(fv.workdir, text, step=fv.step, mask_char=fv.mask_char, mask_spans=fv.mask_spans,
                 per_pass=fv.per_pass, escapes=fv.escapes and fv.text is not None)
    return 0


def recall_main(argv=None) -> int:
    """``longctx-recall``: accuracy and answer loss by distance on a generated recall task."""
    from absl import flags

    def define(fv):
        flags.DEFINE_string("task", None, "generated task: mqar, passkey or copy (default: the task the run was "
                            "trained on, else passkey)", flag_values=fv)
        flags.DEFINE_integer("length", None, "tokens per evaluation row (default: train.seq_len); longer rows "
                             "probe distances beyond the training length", flag_values=fv)
        flags.DEFINE_list("lengths", None, "several row lengths: the needle grid (accuracy by length x depth of the "
                          "needle, --bins depths), as a table and a heat map", flag_values=fv)
        flags.DEFINE_integer("rows", None, "evaluation rows (= --config.data.synthetic.eval_rows)", flag_values=fv)
        flags.DEFINE_integer("bins", None, "distance bins (= --config.data.synthetic.bins)", flag_values=fv)
        flags.DEFINE_integer("step", None, "checkpoint step (default: the newest valid one)", flag_values=fv)
        flags.DEFINE_string("out", None, "folder for the JSON and the plot (default: WORKDIR/recall)", flag_values=fv)

    with user_errors():
        fv, overrides = parse(argv, "longctx-recall", config="run", define=define)
        if fv.check:
            return _check_run("longctx-recall", fv, overrides)
        from longctx.recall import needle_grid, recall_run  # deferred: CLI start-up: no jax at import

        if fv.lengths:
            if fv.length is not None:
                raise ConfigError("give --length (one row length) or --lengths (the needle grid), not both")
            try:
                lengths = [int(x) for x in fv.lengths]
            except ValueError:
                raise ConfigError(f"--lengths={','.join(fv.lengths)}: row lengths are integers") from None
            needle_grid(fv.workdir, lengths, task=fv.task, rows=fv.rows, bins=fv.bins, step=fv.step,
                        overrides=overrides, progress=fv.progress, out=fv.out)
            return 0
        recall_run(fv.workdir, task=fv.task, length=fv.length, rows=fv.rows, bins=fv.bins, step=fv.step,
                   overrides=overrides, progress=fv.progress, out=fv.out)
    return 0


def recall_report_main(argv=None) -> int:
    """``longctx-recall-report``: one markdown table and one plot from several runs' recall results."""
    from absl import flags

    def define(fv):
        flags.DEFINE_list("runs", None, "run directories, comma-separated", flag_values=fv)
        flags.DEFINE_string("out", "bench_out/recall", "folder for recall.md, recall.json and recall.png",
                            flag_values=fv)
        flags.DEFINE_string("task", None, "use each run's newest result for this task", flag_values=fv)
        flags.DEFINE_integer("length", None, "... and this row length", flag_values=fv)
        flags.DEFINE_string("title", "", "heading of the table and the plot", flag_values=fv)
        flags.DEFINE_boolean("merge", False, "keep the rows already in OUT/recall.json (runs not given again): "
                             "add new runs to a table whose runs are gone", flag_values=fv)

    with user_errors():
        fv, overrides = parse(argv, "longctx-recall-report", config="run", define=define, require_workdir=False)
        if overrides:
            raise ConfigError("longctx-recall-report takes no --config.* overrides")
        if not fv.runs:
            raise ConfigError("--runs is required: the run directories to tabulate, comma-separated")
        if fv.check:
            print(f"ok: longctx-recall-report would tabulate {len(fv.runs)} run(s) into {fv.out}")
            return 0
        from longctx.recall import report  # deferred: CLI start-up: no jax at import

        report(fv.runs, fv.out, task=fv.task, length=fv.length, title=fv.title, merge=fv.merge)
    return 0
