"""``longctx-convert``: Hugging Face folders in and out.

    longctx-convert import --hf_dir=DIR --workdir=OUT [--config=FILE[:VARIANT]] [--config.KEY=VALUE ...]
                           [--dry_run] [--nooptimizer_state] [--rope_theta=BASE] [--extend_positions=N]
    longctx-convert import --hf_dir=DIR --plan [--config=FILE[:VARIANT]] [--config.KEY=VALUE ...]
    longctx-convert export --workdir=RUN --hf_dir=OUT [--step=N]

``import`` takes a config file and overrides as ``longctx-train`` does (default ``configs/default.py``): the run
keeps its data, train, eval and execution sections and its model's precision and layout keys, while config.json
decides the architecture. Both take ``--check`` (parse, validate, stop). The entry point parses its flags and
calls one function (:mod:`longctx.convert.core`); a user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys

from longctx import cli
from longctx.cli import user_errors
from longctx.convert.errors import ConvertError

USAGE = ("usage: longctx-convert import --hf_dir=DIR --workdir=OUT [--config=FILE[:VARIANT]] [--config.KEY=VALUE] "
         "[--dry_run] [--nooptimizer_state] [--rope_theta=BASE] [--extend_positions=N]\n"
         "       longctx-convert import --hf_dir=DIR --plan [--config=FILE[:VARIANT]] [--config.KEY=VALUE]\n"
         "       longctx-convert export --workdir=RUN --hf_dir=OUT [--step=N]")
ABOUT = ("import: a local Hugging Face folder of a decoder (config.json with model_type llama, mistral, qwen2 or "
         "gpt2) or a masked-LM encoder (bert, roberta) (*.safetensors, sharded or not; tokenizer.json) -> a longctx "
         "run folder that longctx-eval, longctx-sample and longctx-train (resume: --config=OUT/config.py "
         "--workdir=OUT) take; --config.model.attention.pattern=dense,eva runs another method in chosen layers.\n"
         "export: a run whose model is in one of those families -> config.json + model.safetensors that transformers "
         "loads. docs/pretrained.md has the whole path.")


def _define_import(fv):
    from absl import flags

    flags.DEFINE_string("hf_dir", None, "the Hugging Face folder to read (config.json, *.safetensors, tokenizer.json)",
                        flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "check config.json and every tensor's name and shape; write nothing",
                      flag_values=fv)
    flags.DEFINE_bool("plan", False, "from config.json alone (no tensor read, no --workdir): compile the run's train "
                      "step for the config's mesh and print per-device memory (parameters, optimizer state, "
                      "activations), the sharding and FLOPs, as longctx-train --dry_run; write nothing",
                      flag_values=fv)
    flags.DEFINE_bool("optimizer_state", True, "write a fresh optimizer state beside the parameters (needed by "
                      "longctx-train to resume; --nooptimizer_state: about a third of the memory and disk)",
                      flag_values=fv)
    flags.DEFINE_float("rope_theta", None, "the run's rotary base instead of config.json's (context extension: a "
                       "larger base, e.g. 500000, before continued pretraining at a longer context)", flag_values=fv)
    flags.DEFINE_integer("extend_positions", 1, "learned positions (GPT-2, BERT, RoBERTa) N times as many, the "
                         "source's rows copied N times (Longformer's and VCC's initialisation; train.seq_len up to "
                         "the new length)", flag_values=fv)


def _parse_export(argv):
    from absl import flags

    fv = flags.FlagValues()
    flags.DEFINE_string("workdir", None, "the longctx run to read", flag_values=fv)
    flags.DEFINE_string("hf_dir", None, "the Hugging Face folder to write (new or empty)", flag_values=fv)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the newest valid one)", flag_values=fv)
    flags.DEFINE_bool("check", False, "parse the flags, print what would run, and stop", flag_values=fv)
    flags.DEFINE_bool("progress", True, "accepted for the common flag style; export prints no progress bar",
                      flag_values=fv)
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
        print(f"{USAGE}\n\n{ABOUT}\n\nflags of export:\n{fv.get_help()}")
        raise SystemExit(0)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise ConvertError(f"{' '.join(str(e).split())} (longctx-convert export --help lists the flags)") from None
    if len(rest) > 1:
        raise ConvertError(f"unexpected argument {rest[1]!r}; flags take the form --name=value")
    return fv


def main(argv=None) -> int:
    with user_errors():
        argv = list(sys.argv if argv is None else argv)
        if len(argv) < 2 or argv[1] in ("-h", "--help", "--helpshort", "--helpfull", "help"):
            print(f"{USAGE}\n\n{ABOUT}")
            return 0 if len(argv) >= 2 else 2
        command, rest = argv[1], [f"{argv[0]} {argv[1]}", *argv[2:]]
        if command == "import":
            fv, cfg = cli.parse(rest, "longctx-convert import", config="file", define=_define_import,
                                require_workdir=False)
        elif command == "export":
            fv, cfg = _parse_export(rest), None
        else:
            raise ConvertError(f"unknown command {command!r}; allowed: import, export ({USAGE.splitlines()[0][7:]})")
        planning = command == "import" and fv.plan
        for name in ("hf_dir",) if planning else ("hf_dir", "workdir"):
            if not fv[name].value:
                raise ConvertError(f"longctx-convert {command} needs --{name}")
        if fv.check:
            if cfg is not None:
                from longctx import config as config_lib  # deferred: CLI start-up: no jax at import

                config_lib.validate(cfg)
            print(f"ok: longctx-convert {command} would convert --hf_dir={fv.hf_dir} --workdir={fv.workdir} "
                  "(--check: nothing read or written)")
            return 0
        from longctx.convert import core  # deferred: CLI start-up: no jax at import

        if planning:
            core.plan_hf(fv.hf_dir, config=cfg, rope_theta=fv.rope_theta, extend=fv.extend_positions)
        elif command == "import":
            core.import_hf(fv.hf_dir, fv.workdir, config=cfg, dry_run=fv.dry_run, optimizer_state=fv.optimizer_state,
                           rope_theta=fv.rope_theta, extend=fv.extend_positions)
        else:
            core.export_hf(fv.workdir, fv.hf_dir, step=fv.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
