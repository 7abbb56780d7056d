"""Command-line entry points: longctx-train (longctx-eval and longctx-sample live
in evaluate.py and sample.py)."""

from __future__ import annotations

import sys

from longctx.errors import ConfigError


def load_config(argv: list[str], *, require_workdir: bool = True):
    """Parse --config=FILE [--config.a.b=value ...] --workdir=DIR in the config_flags idiom.

    ``require_workdir=False`` (longctx-prepare) makes --workdir optional."""
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    # sys_argv: config_flags finds the --config.* overrides in it (by default it reads sys.argv, not argv)
    config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config file", flag_values=fv, lock_config=True,
                                    sys_argv=list(argv))
    flags.DEFINE_string("workdir", None, "run directory (checkpoints, logs, plots)", flag_values=fv)
    flags.DEFINE_integer("max_steps", None, "stop after this many steps in this invocation (for tests)", flag_values=fv)
    flags.DEFINE_bool("progress", True, "show progress bars", flag_values=fv)
    try:
        fv([argv[0]] + argv[1:])
        cfg = fv.config
        cfg.keys()  # a config file that failed to load raises here
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(_unknown_flag_message(e, argv)) from None
    except flags.IllegalFlagValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    except AttributeError as e:
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ")
        raise ConfigError(f"unknown config key: {msg}") from None
    except (OSError, ImportError, SyntaxError) as e:
        first = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ConfigError(f"cannot load the config file: {' '.join(first[-2:])}") from None
    except flags.Error as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if require_workdir and not fv.workdir:
        raise ConfigError("--workdir is required (where checkpoints, logs and plots go), e.g. --workdir runs/default")
    return cfg, fv.workdir, fv.max_steps, fv.progress


def _unknown_flag_message(err, argv) -> str:
    import difflib
    import runpy

    name = getattr(err, "flagname", "") or str(err)
    if not name.startswith("config."):
        return f"unknown flag --{name}; allowed: --config, --config.<key>=<value>, --workdir, --max_steps, --progress"
    parts = name.split(".")[1:]
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "configs/default.py")
    try:
        node = runpy.run_path(path)["get_config"]()
        for p in parts[:-1]:
            node = node[p]
        keys = sorted(node.keys())
    except Exception:  # the key path itself is wrong higher up
        return f"unknown config key {'.'.join(parts)!r}"
    close = difflib.get_close_matches(parts[-1], keys, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {'.'.join(parts)!r}{hint}; allowed keys there: {', '.join(keys)}"


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


def train_main(argv=None) -> int:
    from longctx import config as config_lib
    from longctx.runtime import user_errors
    from longctx.train.loop import train

    argv = join_config_flag(list(sys.argv if argv is None else argv))
    with user_errors():
        cfg, workdir, max_steps, progress = load_config(argv)
        config_lib.check_against_base(cfg)
        summary = train(cfg, workdir, progress=progress, max_steps=max_steps)
        print(f"done: step {summary['step']}, last valid bits/token {summary['last_valid_bits_per_token']}")
    return 0
