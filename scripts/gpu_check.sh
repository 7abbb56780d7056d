#!/usr/bin/env bash
# The first thing to run whenever an accelerator is available: one markdown report and its JSON,
# results/gpu/<date>-<device>.md / .json, with the step outputs in results/gpu/<date>-<device>/.
#
#   bash scripts/gpu_check.sh                       # on the GPU (at most 8.5 minutes: the steps' limits)
#   bash scripts/gpu_check.sh --smoke --out /tmp/x  # the same steps at tiny shapes on the CPU (the default
#                                                   # test suite runs this: tests/test_gpu_check.py)
#   STEPS=none bash scripts/gpu_check.sh --out DIR --stamp STAMP
#                                                   # the report again from DIR/STAMP's step outputs (a run cut
#                                                   # short, or its outputs fetched from another machine)
#
# Steps, each under its own `timeout` and writing its files as it goes (a slow step costs only itself; the
# report says which step failed or ran out of time and shows the end of its log). The default steps answer "how
# far from cuDNN, and where does the time go" within their limits (the defaults below, added up in the first
# line), so that one lease leaves time to fix something and run again:
#   env       jax / jaxlib / plugin versions (and whether jax lies in pyproject's supported range), the
#             device, driver and cuDNN, the commit
#   tests     compiled on the device: the compute-dtype test of every implementation (cuDNN's traced there), one
#             bfloat16 forward+gradient case per kernel (tests/kernels, interpret mode off on an accelerator) and
#             cuDNN over packed rows against each document alone (test_dense_platform.py, skipped off Hopper);
#             STEPS=all runs the whole compiled kernel suite and dense's cuDNN / splash tests instead;
#             GPU_CHECK_TESTS="PATHS" runs others
#   attention exact attention (dense:cudnn on a GPU, dense:splash on a TPU; timed first, the baseline of every
#             ratio in the report) against every causal method as shipped, 8k and 32k, forward and
#             forward+backward, at the bench's accelerator defaults (B8 H8 d64 bf16), TFLOP/s and % of the
#             device's bf16 peak (`longctx-bench attention`)
#   attention_128k  the same at 128k (an out-of-memory is a result: the row says so)
#   precision every method with a kernel at 32k in float32, beside the attention step's bfloat16 rows
#   profile_tvq, profile_eva  one compiled forward+backward of the Transformer-VQ / EVA core at 32k traced
#             (`longctx-bench profile`): the time in kernels against the time in XLA's own ops (the glue)
#   kernels   each Pallas kernel against its XLA path at the same shapes, at 32k (`longctx-bench kernels`)
#   sweep     each kernel's declared knobs (tiles, warps, stages, budgets) tried at half and twice their platform
#             default, one at a time, at 32k forward+backward; the fastest setting and the `defaults` entry it
#             proposes for the platform (`longctx-bench sweep`)
#   step_*    the training step of three configs at 2 and at 4 layers (`longctx-bench step`), each at its own row
#             and window: enwik8 Transformer-VQ (8k rows in 2k windows, batch 8), WikiText-103 EVA (512 words,
#             batch 32, the 267,735-word vocabulary), enwik8 FMA (1k bytes, batch 64): tokens/s, model FLOPs per
#             token, MFU against the device's bf16 peak, and per layer (the 4-layer step less the 2-layer one:
#             the embedding, head and loss cancel), compile time, device peak memory
#   attention_d128  exact attention, its XLA tiles and the kernel methods at head dim 128 (8k, 32k); STEPS=all
#   memplan   the flagship config's memory plan compiled on the device (`longctx-train --dry_run`); STEPS=all
#   compile   the Transformer-VQ flagship's training step compiled at 4 and at 48 layers (its depth): compile
#             seconds at each depth, whether depth costs compile time (`longctx-bench step`); STEPS=all
#   decode    one decoding step of every causal core at 8k and 32k (B1 H8 d64 bf16, KV caches in bf16 as a
#             model keeps them on the device, the state donated as sampling donates it), then of the main config's
#             whole model with dense, KDEformer and EVA at 32k (its layers scanned as the device resolves it): ms
#             per token, state size, and the step's XLA temporaries (dense and KDEformer write the token into the
#             state in place on XLA:CPU, scanned or not; whether they do on the device) (`longctx-bench decode`,
#             `--model`); STEPS=all
# Per step: GPU_CHECK_LIMIT_<STEP>=seconds (e.g. GPU_CHECK_LIMIT_ATTENTION=240); STEPS="env tests" runs a subset,
# STEPS=all every step (the report is always written, from every step output in the folder). --smoke writes to a
# scratch folder (printed) unless --out is given.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
SMOKE=0
OUT=""
STAMP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --stamp) STAMP="$2"; shift ;;
    --stamp=*) STAMP="${1#--stamp=}" ;;
    -h|--help) sed -n '2,48p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: gpu_check.sh: unknown argument $1 (use --smoke, --out DIR, --stamp NAME)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$SMOKE" = 1 ] && [ -z "$OUT" ]; then OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-smoke.XXXXXX")"; fi
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
fi

if [ -z "$STAMP" ]; then
DEVICE="$(timeout 120 "$PY" -c 'import jax, re; d = jax.devices()[0]; print(re.sub(r"[^A-Za-z0-9]+", "-", d.device_kind).strip("-") or d.platform)' 2>/dev/null || echo unknown)"
STAMP="$(date -u +%Y-%m-%d)-$DEVICE"
[ "$SMOKE" = 1 ] && STAMP="$STAMP-smoke"
fi
WORK="$OUT/$STAMP"
mkdir -p "$WORK"
BENCH=("$PY" -m longctx.bench.cli)
ALL_STEPS="env tests attention attention_128k precision profile_tvq profile_eva kernels sweep step_tvq step_eva
           step_fma attention_d128 memplan compile decode"
ALL_STEPS="$(echo $ALL_STEPS)"
if [ "$SMOKE" = 1 ]; then STEPS="${STEPS:-all}"; fi
STEPS="${STEPS:-env tests attention attention_128k precision profile_tvq profile_eva kernels sweep step_tvq step_eva
         step_fma}"
STEPS="$(echo $STEPS)"
FULL_TESTS=0
[ "$STEPS" = all ] && FULL_TESTS=1
[ "$STEPS" = all ] && STEPS="$ALL_STEPS"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [ "$SMOKE" = 1 ]; then
  LIMIT_DEFAULT=300  # the steps overlap on a CPU that may be busy
  TESTS=(tests/kernels/test_vq_cache.py -k "export_lowering")
  ISOLATE=(--noisolate)
  ATTN=(--lengths 256 --batch 1 --heads 2 --head_dim 16 --dtype float32
        --repeats 1 --warmup 0)
  ATTN128=(--methods dense:naive --lengths 256 --batch 1 --heads 2 --head_dim 32 --dtype float32 --repeats 1
           --warmup 0)
  KERN=(--methods transformer_vq --lengths 256 --batch 1 --heads 2 --head_dim 16 --dtype float32 --repeats 1
        --warmup 0 --no_backward)
  ATTN_LONG=(--lengths 512 --batch 1 --heads 2 --head_dim 16 --repeats 1 --warmup 0)
  PREC=(--methods transformer_vq --lengths 256 --batch 1 --heads 2 --head_dim 16 --repeats 1 --warmup 0)
  PROF=(--length 256 --batch 1 --heads 2 --head_dim 16 --dtype float32 --calls 1 --warmup 0)
  SWEEP=(--methods fma --length 128 --batch 1 --heads 2 --head_dim 16 --dtype float32 --repeats 1 --warmup 0
         --max_settings 3)
  STEP=(--repeats 1 --warmup 0 --matmul_n 512)
  STEP_TVQ=(--lengths 128 --batch_size 1)
  STEP_EVA=(--lengths 128 --batch_size 1 --vocab_size 256)
  STEP_FMA=(--lengths 128 --batch_size 1)
  DEPTHS="1 2"
  COMPILE_DEPTHS="1 3"
  DECODE=(--methods dense,kdeformer --positions 4k --heads 4 --head_dim 64 --dtype float32 --steps 2 --warmup 1)
  DECODE_MODEL=(--methods dense,kdeformer --positions 4k --dtype float32 --steps 2 --warmup 1 --scan_layers on)
  VARIANT=":tiny"
  EXACT="dense:naive"
else
  LIMIT_DEFAULT=150
  if [ "$FULL_TESTS" = 1 ]; then
    read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/kernels tests/attention/test_dense_platform.py tests/attention/test_compute_dtype.py tests/attention/test_hopper_path.py}"
  elif [ -n "${GPU_CHECK_TESTS:-}" ]; then
    read -r -a TESTS <<< "$GPU_CHECK_TESTS"
  else  # one bfloat16 forward+gradient case per kernel (the Mosaic GPU ones compiled on Hopper), the dtypes every
        # implementation's products take, cuDNN's packed layout (segment ids) against each document alone, outputs
        # and gradients, cuDNN's different-value-width form (keys 128, values 384) against the reference, and each
        # layer as 'auto' runs it on Hopper (the Mosaic GPU kernels) against its XLA path
    TESTS=(tests/kernels tests/attention/test_compute_dtype.py tests/attention/test_dense_platform.py
           tests/attention/test_hopper_path.py
           -k "compute_dtype or (gradient_matches and bfloat16) or packed_rows_compiled or value_width_compiled or hopper_compiled")
  fi
  TESTS+=(--maxfail=5)
  # one process for every variant: a process start with CUDA costs seconds, and the rows are kept after each cell
  ISOLATE=(--noisolate)
  # every method as shipped (the bench lists dense:cudnn on a GPU, dense:splash on a TPU)
  # shapes, dtype and calls per timing sample: the bench's accelerator defaults (B8 H8 d64 bf16)
  ATTN=(--lengths 8k,32k --repeats 3 --warmup 1 --mem_budget_gb 60 --max_cell_s 15)
  # 128k: forward+backward rows of every method; a cell that does not fit is recorded as such
  ATTN_LONG=(--lengths 128k --repeats 2 --warmup 1 --mem_budget_gb 75 --max_cell_s 10)
  # float32 against the attention step's bfloat16 rows, the methods whose kernels take the compute dtype
  PREC=(--methods transformer_vq,eva,fma --lengths 32k --dtype float32 --repeats 2 --warmup 1 --max_cell_s 8)
  PROF=(--length 32k --batch 8 --heads 8 --head_dim 64 --dtype bfloat16 --calls 3 --warmup 1)
  # the kernel never timed compiled first (transformer_vq's vq_cache), then fma's and eva's
  KERN=(--methods transformer_vq,fma,eva --lengths 32k --repeats 3 --warmup 1 --max_cell_s 15)
  # each kernel's knobs at 32k forward+backward: the baseline and up to 6 single-knob moves per kernel
  SWEEP=(--methods transformer_vq,eva,fma --length 32k --repeats 2 --warmup 1 --max_settings 7)
  STEP=(--repeats 3 --warmup 1)
  STEP_TVQ=(--lengths 8k --window 2048 --batch_size 8)
  STEP_EVA=(--lengths 512 --batch_size 32 --vocab_size 267735)
  STEP_FMA=(--lengths 1k --batch_size 64)
  DEPTHS="2 4"
  COMPILE_DEPTHS="4 48"
  DECODE=(--positions 8k,32k --heads 8 --head_dim 64 --dtype bfloat16 --steps 16 --warmup 2 --max_prefill_s 20)
  DECODE_MODEL=(--methods dense,kdeformer,eva --positions 32k --dtype bfloat16 --steps 16 --warmup 2
                --max_prefill_s 20)
  VARIANT=""
  EXACT="$("$PY" -c 'from longctx.attention import dispatch; print({"cuda": "dense:cudnn", "tpu": "dense:splash"}.get(dispatch.current_platform(), "dense:naive"))' 2>/dev/null || echo dense:naive)"
  # head dim 128 (the other common training shape): exact attention, its XLA tiles and the causal methods as
  # shipped, at the bench's accelerator batch and heads, two lengths
  ATTN128=(--methods "$EXACT,dense:blockwise,transformer_vq,eva,fma" --head_dim 128 --lengths 8k,32k --repeats 3
           --warmup 1 --mem_budget_gb 60 --max_cell_s 10)
fi

# exact attention first (a limit may stop the run), then every causal method as shipped, sliding-window attention
# (its default window, cuDNN's local mask) last
if [ "$SMOKE" = 1 ]; then ATTN_METHODS="$EXACT,transformer_vq"; else
  ATTN_METHODS="$EXACT,transformer_vq,eva,fma,fma_linear,kdeformer,swa"; fi

# the exact row the report compares with: the one this folder's attention step ran with (a report made again
# elsewhere, STEPS=none, keeps it)
if [ -s "$WORK/exact.txt" ] && [[ " $STEPS " != *" attention "* ]]; then EXACT="$(cat "$WORK/exact.txt")"; else
  echo "$EXACT" > "$WORK/exact.txt"; fi

limit() {  # the step's time limit: GPU_CHECK_LIMIT_<STEP>, else its own (on the accelerator) or the smoke default
  local var="GPU_CHECK_LIMIT_$(echo "$1" | tr '[:lower:]' '[:upper:]')"
  if [ "$SMOKE" = 1 ]; then echo "${!var:-$LIMIT_DEFAULT}"; else echo "${!var:-${2:-$LIMIT_DEFAULT}}"; fi
}

step() {  # on the accelerator one step after another; the CPU smoke run overlaps them (compiles dominate it)
  if [ "$SMOKE" = 1 ]; then run_step "$@" & else run_step "$@"; fi
}

run_step() {  # run_step NAME LIMIT CMD...: log to WORK/NAME.log, status to WORK/NAME.status.json
  local name="$1" lim="$2"; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${lim}s): $*"
  printf '{"step": "%s", "status": "running", "limit_s": %s}\n' "$name" "$lim" > "$WORK/$name.status.json"
  local t0=$SECONDS rc status
  timeout --kill-after=15 "$lim" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  printf '{"step": "%s", "status": "%s", "rc": %d, "wall_s": %d, "limit_s": %s, "command": "%s"}\n' \
    "$name" "$status" "$rc" $((SECONDS - t0)) "$lim" "$(echo "$*" | sed 's/"/\\"/g')" > "$WORK/$name.status.json"
  echo "   $status (rc $rc, $((SECONDS - t0)) s)"
}

cat > "$TMP/env.py" <<'EOF'
import json, platform, re, subprocess, sys
import jax, jaxlib
info = {"smoke": sys.argv[2] == "1", "python": platform.python_version(), "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "backend": jax.default_backend()}
def _v(text):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])
try:  # pyproject's [tool.longctx] supported-jax, e.g. ">=0.10.2,<0.12"
    import tomllib
    rng = tomllib.load(open("pyproject.toml", "rb"))["tool"]["longctx"]["supported-jax"]
    ops = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
           "==": lambda a, b: a == b}
    inside = True
    for part in rng.split(","):
        op, ver = re.match(r"\s*(>=|<=|==|<|>)\s*([\d.]+)", part).groups()
        n = len(_v(ver))
        inside = inside and ops[op](_v(jax.__version__)[:n], _v(ver))
    info["jax_supported_range"], info["jax_in_supported_range"] = rng, inside
except Exception as e:  # noqa: BLE001
    info["jax_supported_range"], info["jax_in_supported_range"] = f"unknown ({type(e).__name__})", None
devs = jax.devices()
info["devices"] = [f"{d.platform}:{d.device_kind}" for d in devs]
info["device"] = devs[0].device_kind
info["compute_capability"] = getattr(devs[0], "compute_capability", None)
try:
    from jax._src.lib import cuda_versions
    info["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
except Exception as e:  # noqa: BLE001
    info["cudnn"] = f"unknown ({type(e).__name__})"
try:
    from importlib import metadata
    info["packages"] = {d.metadata["Name"]: d.version for d in metadata.distributions()
                        if d.metadata["Name"] and ("jax" in d.metadata["Name"].lower()
                                                   or d.metadata["Name"].lower().startswith(("nvidia-cudnn", "libtpu")))}
except Exception:  # noqa: BLE001
    info["packages"] = {}
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return None
info["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"])
info["commit"] = run(["git", "rev-parse", "--short", "HEAD"])
info["dirty"] = bool(run(["git", "status", "--porcelain", "--untracked-files=no"]))
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
EOF
step env "$(limit env 20)" "$PY" "$TMP/env.py" "$WORK/env.json" "$SMOKE"

step tests "$(limit tests 50)" "$PY" -m pytest -q -n 0 -p no:cacheprovider --junitxml="$WORK/tests.xml" "${TESTS[@]}"
step attention "$(limit attention 100)" "${BENCH[@]}" attention --out "$WORK/attention" --causal --matmul_n 0 \
  --no_torch --noprogress "${ISOLATE[@]}" --methods "${ATTN_METHODS}" "${ATTN[@]}"
step attention_128k "$(limit attention_128k 50)" "${BENCH[@]}" attention --out "$WORK/attention_128k" --causal \
  --matmul_n 0 --no_torch --noprogress "${ISOLATE[@]}" --methods "${ATTN_METHODS}" "${ATTN_LONG[@]}"
step precision "$(limit precision 35)" "${BENCH[@]}" attention --out "$WORK/precision" --causal --matmul_n 0 \
  --no_torch --noprogress "${ISOLATE[@]}" "${PREC[@]}"
step profile_tvq "$(limit profile_tvq 25)" "${BENCH[@]}" profile --out "$WORK/profile_tvq" --noprogress \
  --method transformer_vq --top 12 "${PROF[@]}"
step profile_eva "$(limit profile_eva 25)" "${BENCH[@]}" profile --out "$WORK/profile_eva" --noprogress \
  --method eva --top 12 "${PROF[@]}"
step attention_d128 "$(limit attention_d128 45)" "${BENCH[@]}" attention --out "$WORK/attention_d128" --causal \
  --matmul_n 0 --no_torch --noprogress "${ISOLATE[@]}" "${ATTN128[@]}"
step kernels "$(limit kernels 50)" "${BENCH[@]}" kernels --out "$WORK/kernels" --causal --noprogress "${KERN[@]}"
step sweep "$(limit sweep 60)" "${BENCH[@]}" sweep --out "$WORK/sweep" --noprogress "${SWEEP[@]}"
# the training step at each depth of DEPTHS: model_steps.sh OUTNAME CONFIG ARGS... -> WORK/OUTNAME_l<depth>/
cat > "$TMP/model_steps.sh" <<STEPS_EOF
rc=0
name="\$1" config="\$2"; shift 2
for d in \${DEPTHS_RUN:-$DEPTHS}; do
  $(printf '%q ' "${BENCH[@]}") step --config "\$config" --out "$WORK/\${name}_l\$d" --noprogress "\$@" \
    --config.model.num_layers=\$d || rc=\$?
done
exit \$rc
STEPS_EOF
step step_tvq "$(limit step_tvq 30)" bash "$TMP/model_steps.sh" step_tvq "configs/enwik8/transformer_vq.py$VARIANT" \
  "${STEP[@]}" "${STEP_TVQ[@]}"
step step_eva "$(limit step_eva 35)" bash "$TMP/model_steps.sh" step_eva "configs/wikitext103/eva_16l.py$VARIANT" \
  "${STEP[@]}" "${STEP_EVA[@]}"
step step_fma "$(limit step_fma 25)" bash "$TMP/model_steps.sh" step_fma "configs/enwik8/fma.py$VARIANT" \
  "${STEP[@]}" "${STEP_FMA[@]}"
step compile "$(limit compile 120)" env DEPTHS_RUN="$COMPILE_DEPTHS" bash "$TMP/model_steps.sh" compile \
  "configs/enwik8/transformer_vq.py$VARIANT" "${STEP[@]}" "${STEP_TVQ[@]}"
# the cores alone, then the main config's whole model with each method (its layers scanned where the platform
# resolves model.scan_layers on): decode.sh -> WORK/decode/, WORK/decode_model/
cat > "$TMP/decode.sh" <<DECODE_EOF
rc=0
$(printf '%q ' "${BENCH[@]}") decode --out "$WORK/decode" --batch 1 --noprogress $(printf '%q ' "${DECODE[@]}") || rc=\$?
$(printf '%q ' "${BENCH[@]}") decode --model configs/main.py --out "$WORK/decode_model" --batch 1 --noprogress \
  $(printf '%q ' "${DECODE_MODEL[@]}") || rc=\$?
exit \$rc
DECODE_EOF
step decode "$(limit decode 120)" bash "$TMP/decode.sh"
step memplan "$(limit memplan 90)" "$PY" -c 'import sys; from longctx.cli import train_main; sys.exit(train_main())' \
  --config="configs/enwik8/transformer_vq.py$VARIANT" --dry_run --workdir="$TMP/memplan"
wait

# ------------------------------------------------------------------------------------------------- the report
"$PY" - "$WORK" "$OUT/$STAMP" "$EXACT" <<'EOF'
import json, math, sys, xml.etree.ElementTree as ET
from pathlib import Path
work, base, exact = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
STEPS = ["env", "tests", "attention", "attention_128k", "precision", "profile_tvq", "profile_eva", "kernels",
         "sweep", "step_tvq", "step_eva", "step_fma", "attention_d128", "memplan", "compile", "decode"]

def load(p):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return None

def tail(name, n=25):
    try:
        lines = (work / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])

def fmt(x, nd=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)

status = {s: load(work / f"{s}.status.json") or {"step": s, "status": "not run"} for s in STEPS}

def fallback_peak():
    """The device's bf16 peak from env.json's device kind (a step stopped by its limit wrote rows without one)."""
    env = load(work / "env.json") or {}
    if env.get("backend") in (None, "cpu"):
        return {}
    try:
        from longctx.bench.common import device_peak
        return device_peak(env["backend"], env.get("device") or "")
    except Exception as e:  # noqa: BLE001
        return {"tflops": None, "reason": f"no peak ({type(e).__name__})"}
report = {"stamp": Path(base).name, "exact": exact, "steps": status}
md = [f"# Accelerator check {Path(base).name}", ""]

def section(title, name, body):
    st = status[name]
    md.extend([f"## {title}", "", f"step `{name}`: **{st['status']}**"
               + (f" ({st.get('wall_s')} s of {st.get('limit_s')} s)" if "wall_s" in st else ""), ""])
    if st["status"] != "ok":
        md.extend(["```", tail(name) or "(no log)", "```", ""])
    md.extend(body)
    md.append("")

env = load(work / "env.json") or {}
report["env"] = env
section("Environment", "env", [f"- {k}: `{v}`" for k, v in env.items()])

tests = {}
try:
    r = ET.parse(work / "tests.xml").getroot()
    suite = r if r.tag == "testsuite" else r.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    tests["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError, AttributeError):
    pass
if not tests:  # no JUnit file (the step ran out of time): count pytest's progress characters in its log
    try:
        prog = "".join(l.split("[")[0].strip() for l in (work / "tests.log").read_text(errors="replace").splitlines()
                       if l.strip() and set(l.split("[")[0].strip()) <= set(".sFExX"))
    except OSError:
        prog = ""
    if prog:
        tests = {"tests": len(prog), "failures": prog.count("F"), "errors": prog.count("E"),
                 "skipped": prog.count("s"), "counted_from_log": True}
report["tests"] = tests
section("Kernel tests, compiled", "tests",
        [f"{tests.get('tests', 0)} tests: {tests.get('failures', 0)} failed, {tests.get('errors', 0)} errors, "
         f"{tests.get('skipped', 0)} skipped"
         + (" (the tests that ran before the step was stopped, counted from its log)"
            if tests.get("counted_from_log") else "")] + [f"- failed: `{f}`" for f in tests.get("failed", [])])

def attention_section(name, title):
    att = load(work / name / "attention.json") or load(work / name / "attention.partial.json") or {}
    rows = att.get("rows", []) if isinstance(att, dict) else []
    report[name] = rows
    ref = {(r.get("direction"), r.get("length")): r for r in rows if r.get("variant") == exact}
    a_args = (att.get("header") or {}).get("args", {}) if isinstance(att, dict) else {}
    if not a_args and rows:  # a run stopped by its limit: the shapes from its rows
        a_args = {k: rows[0].get(k) for k in ("batch", "heads", "head_dim", "dtype")}
        a_args["calls_per_sample"] = "not recorded (the step was stopped)"
    peak = (att.get("peak") or {}) if isinstance(att, dict) else {}
    if not peak.get("tflops") and rows and fallback_peak().get("tflops"):
        peak = fallback_peak()
        for r in rows:  # as the bench's add_peak_fractions: the analytic rate, else XLA's count
            rate = (r.get("fwdbwd_analytic_gflops_per_s") or r.get("fwdbwd_method_gflops_per_s")
                    or r.get("fwdbwd_xla_gflops_per_s"))
            if rate and "fwdbwd_peak_fraction" not in r:
                r["fwdbwd_peak_fraction"] = rate / (peak["tflops"] * 1e3)
    body = [f"Exact row: `{exact}`; ratio = method time / exact time (below 1: faster than exact attention). Shapes: "
            f"batch {a_args.get('batch')}, heads {a_args.get('heads')}, head_dim {a_args.get('head_dim')}, "
            f"{a_args.get('dtype')}, calls per timing sample {a_args.get('calls_per_sample')} (0: as many as fill 50 ms). "
            + (f"Peak: {peak['tflops'] * 1e3:.4g} GFLOP/s, {peak.get('source')}." if peak.get("tflops")
               else f"No % of peak: {peak.get('reason')}.")
            + " TFLOP/s from the analytic count (exact attention), else the matrix-multiply FLOPs in the method's "
              "jaxpr (a program with kernels: as its portable XLA implementation computes it), else XLA's count "
              "of the program (≥: a lower bound, without the work inside kernels and with a loop's body counted "
              "once).", "",
            "| variant | T | fwd ms | fwd+bwd ms | fwd / exact | fwd+bwd / exact | TFLOP/s fwd+bwd | % of peak fwd+bwd | status |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = ref.get((r.get("direction"), r.get("length")), {})
        ratio = lambda k: (r[k] / e[k]) if r.get(k) and e.get(k) else None  # noqa: E731
        tf = (r.get("fwdbwd_analytic_gflops_per_s") or r.get("fwdbwd_method_gflops_per_s")
              or r.get("fwdbwd_xla_gflops_per_s"))
        if r.get("fwdbwd_analytic_gflops_per_s"):
            lb = ""
        elif r.get("fwdbwd_method_gflops_per_s"):
            lb = "≥" if r.get("method_flops_fwdbwd_lower_bound") else ""
        else:
            lb = "≥"  # XLA's count misses kernels and loop trips
        pf = r.get("fwdbwd_peak_fraction")
        body.append(f"| {r.get('variant')} | {r.get('length')} | {fmt((r.get('fwd_s') or math.nan) * 1e3)} | "
                    f"{fmt((r.get('fwdbwd_s') or math.nan) * 1e3)} | {fmt(ratio('fwd_s'))} | {fmt(ratio('fwdbwd_s'))} | "
                    f"{lb + fmt(tf / 1e3) if tf else '–'} | {lb + fmt(100 * pf) if pf is not None else '–'} | "
                    f"{r.get('fwd_status', '')}/{r.get('fwdbwd_status', '')} |")
    section(title, name, body)

attention_section("attention", "Exact attention against every method")
attention_section("attention_128k", "Exact attention against every method at 128k")

# float32 against bfloat16: the precision step's rows beside the attention step's at the same length
bf = {(r.get("variant"), r.get("length")): r for r in report.get("attention", [])}
prec = load(work / "precision" / "attention.json") or load(work / "precision" / "attention.partial.json") or {}
prows = prec.get("rows", []) if isinstance(prec, dict) else []
report["precision"] = prows
body = ["Each method with a kernel in float32 against the same method in bfloat16 (the attention step's row at that "
        "length): above 1, the compute dtype pays.", "",
        "| variant | T | bf16 fwd+bwd ms | f32 fwd+bwd ms | f32 / bf16 | status |", "|---|---|---|---|---|---|"]
for r in prows:
    b = bf.get((r.get("variant"), r.get("length")), {})
    f, g = r.get("fwdbwd_s"), b.get("fwdbwd_s")
    body.append(f"| {r.get('variant')} | {r.get('length')} | {fmt(g * 1e3 if g else None)} | "
                f"{fmt(f * 1e3 if f else None)} | {fmt(f / g if f and g else None)} | {r.get('fwdbwd_status', '')} |")
section("float32 against bfloat16", "precision", body)

for name, title in (("profile_tvq", "Where Transformer-VQ's time goes"), ("profile_eva", "Where EVA's time goes")):
    prof = load(work / name / "profile.json") or {}
    report[name] = prof
    try:
        text = (work / name / "profile.md").read_text().strip().splitlines()
    except OSError:
        text = []
    # the profile's own tables, one heading level down
    section(title, name, [("#" + line if line.startswith("#") else line) for line in text] or ["(no profile)"])

attention_section("attention_d128", "Exact attention against the methods at head dim 128")

kern = load(work / "kernels" / "kernels.json") or load(work / "kernels" / "kernels.partial.json") or {}
krows = kern.get("rows", []) if isinstance(kern, dict) else []
report["kernels"] = krows
body = ["| method | kernel | T | mode | XLA fwd ms | kernel fwd ms | kernel / XLA fwd | kernel / XLA fwd+bwd | "
        "kernel TFLOP/s fwd | kernel % of peak fwd | max abs diff | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in krows:
    lb = "≥" if r.get("fwd_xla_flops_has_loops") else ""  # the XLA path's count: a lower bound with loops
    kt, kp = r.get("pallas_fwd_tflops"), r.get("pallas_fwd_peak_fraction")
    if kt and kp is None and fallback_peak().get("tflops"):  # a run stopped by its limit wrote no peak
        kp = kt / fallback_peak()["tflops"]
    body.append(f"| {r.get('method')} | {r.get('kernel')} | {r.get('length')} | {r.get('mode')} | "
                f"{fmt((r.get('xla_fwd_s') or math.nan) * 1e3)} | {fmt((r.get('pallas_fwd_s') or math.nan) * 1e3)} | "
                f"{fmt(r.get('fwd_kernel_over_xla'))} | {fmt(r.get('fwdbwd_kernel_over_xla'))} | "
                f"{lb + fmt(kt) if kt else '–'} | {lb + fmt(100 * kp) if kp is not None else '–'} | "
                f"{fmt(r.get('max_abs_diff_out'))} | {r.get('status')} |")
section("Each kernel against its XLA path", "kernels", body)

sweep = load(work / "sweep" / "sweep.json") or {}
report["sweep"] = [{k: v for k, v in kern.items()} for kern in sweep.get("kernels", [])]
try:
    body = (work / "sweep" / "sweep.md").read_text().splitlines()[2:]
except OSError:  # a sweep stopped by its limit: the settings it timed
    body = [f"- {kern.get('method')}: " + "; ".join(
        f"{r.get('settings')} {fmt((r.get('seconds') or math.nan) * 1e3)} ms {r.get('status')}"
        for r in kern.get("rows", [])) for kern in report["sweep"]]
section("Kernel knob sweep", "sweep", [("#" + line if line.startswith("#") else line) for line in body])

body = []
report["steps_model"] = {}
cols = ["T", "batch", "params", "step s", "tokens/s", "MFLOP / token", "TFLOP/s", "MFU %", "compile s",
        "device peak MB", "XLA mem MB"]
report["mfu_definition"] = ("model FLOPs per token = 3 x forward matmul FLOPs counted in the forward's jaxpr "
                            "(longctx-bench step); MFU = that x tokens/s / peak (device bf16 peak on a GPU / TPU, "
                            "the measured f32 matmul rate on a CPU)")
report["per_layer_definition"] = ("per layer: the step at the larger depth less the step at the smaller one, "
                                  "model FLOPs per step over step time (embedding, head and loss cancel)")
for name, title in (("step_tvq", "enwik8 Transformer-VQ"), ("step_eva", "WikiText-103 EVA"),
                    ("step_fma", "enwik8 FMA")):
    runs = {}
    for folder in sorted(work.glob(f"{name}_l*"), key=lambda p: int(p.name.rsplit("_l", 1)[1])):
        d = load(folder / "step.json")
        if isinstance(d, dict):
            runs[int(folder.name.rsplit("_l", 1)[1])] = d
    report["steps_model"][name] = {f"layers_{k}": v for k, v in runs.items()}
    d = next(iter(runs.values()), {})
    pk = (d.get("peak") or {}) if isinstance(d, dict) else {}
    srows = [dict(r, layers=depth) for depth, dd in runs.items() for r in dd.get("rows", [])]
    part = [f"### {title} (`{d.get('config', '?')}`, overrides {d.get('sets', [])})", "",
            f"step `{name}`: **{status[name]['status']}**", "",
            (f"Peak: {pk['tflops'] * 1e3:.4g} GFLOP/s, {pk.get('source')}." if pk.get("tflops")
             else f"MFU not reported: {pk.get('reason')}." if pk else ""), "",
            "| layers | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in srows:
        mem = (r.get("xla_mem") or {}).get("total")
        dev = r.get("device_peak_bytes")
        mf = r.get("model_flops_per_token")
        part.append(f"| {r['layers']} | " + " | ".join(fmt(x) for x in (
            r.get("T"), r.get("batch_size"), r.get("params"), r.get("step_s"), r.get("tokens_per_s"),
            mf / 1e6 if mf else None, r.get("model_tflops_per_s"),
            100 * r["mfu"] if r.get("mfu") is not None else None, r.get("compile_s"),
            dev / 2**20 if dev is not None else None, mem / 2**20 if mem else None)) + " |")
    depths = sorted(runs)
    if len(depths) >= 2:
        lo, hi = ({(r.get("T"), r.get("batch_size")): r for r in runs[x].get("rows", [])} for x in depths[:2])
        for key, a in lo.items():
            b = hi.get(key)
            if not b or not all(x.get(k) for x in (a, b) for k in ("step_s", "model_flops_per_token")):
                continue
            tokens = (key[0] or 0) * (key[1] or 0)
            dl, dt = depths[1] - depths[0], b["step_s"] - a["step_s"]
            dflops = (b["model_flops_per_token"] - a["model_flops_per_token"]) * tokens
            rate = dflops / dt if dt > 0 else None
            peak = pk.get("tflops")
            per = {"T": key[0], "batch_size": key[1], "layers": depths[:2], "ms_per_layer": 1e3 * dt / dl,
                   "tflops_per_s": rate / 1e12 if rate else None,
                   "mfu": rate / (peak * 1e12) if rate and peak else None}
            report["steps_model"][name].setdefault("per_layer", []).append(per)
            part.extend(["", f"Per layer ({depths[1]} layers less {depths[0]}, T {key[0]}, batch {key[1]}): "
                         f"{fmt(per['ms_per_layer'])} ms, {fmt(per['tflops_per_s'])} TFLOP/s"
                         + (f", MFU {fmt(100 * per['mfu'])} %" if per["mfu"] is not None else "")
                         + ("" if dt > 0 else " (the deeper step was not slower: timing noise)") + "."])
    if srows and srows[0].get("device_peak_bytes") is None:
        part.extend(["", f"Device memory: {(srows[0].get('device_mem') or {}).get('reason', 'not recorded')}."])
    if status[name]["status"] != "ok":
        part.extend(["```", tail(name) or "(no log)", "```"])
    body.extend(part + [""])
md.extend(["## Model training steps, reduced depth", ""] + body)

plan = ""
try:
    plan = "\n".join(l for l in (work / "memplan.log").read_text().splitlines()
                     if not l.startswith(("W0", "I0", "E0")))
except OSError:
    pass
report["memplan"] = plan
section("Flagship memory plan (longctx-train --dry_run)", "memplan", ["```", plan.strip() or "(none)", "```"])

comp = {}
for folder in work.glob("compile_l*"):
    d = load(folder / "step.json")
    if isinstance(d, dict) and d.get("rows"):
        comp[int(folder.name.rsplit("_l", 1)[1])] = d["rows"][0]
report["compile"] = {f"layers_{k}": v for k, v in sorted(comp.items())}
body = ["| layers | compile s | step s | params |", "|---|---|---|---|"]
body += [f"| {k} | {fmt(r.get('compile_s'))} | {fmt(r.get('step_s'))} | {fmt(r.get('params'))} |"
         for k, r in sorted(comp.items())]
if len(comp) >= 2:
    lo, hi = sorted(comp)[0], sorted(comp)[-1]
    a, b = comp[lo].get("compile_s"), comp[hi].get("compile_s")
    if a and b:
        body += ["", f"{hi} layers compile in {b / a:.2f}x the time of {lo} ({'scanned' if b / a < 2 else 'unrolled'}"
                 " layers, judged by the ratio)."]
section("Flagship compile time against depth", "compile", body)

dec = load(work / "decode" / "decode.json") or {}
report["decode"] = dec.get("rows", []) if isinstance(dec, dict) else []
dec = load(work / "decode_model" / "decode.json") or {}
report["decode_model"] = dec.get("rows", []) if isinstance(dec, dict) else []
body = ["Cores alone, then the main config's whole model with each method as its attention (`model` column: its layers "
        "and whether they are scanned, the stacked states written in place or not).", "",
        "| method | model | position | cache dtype | ms / token | state MB | XLA temporaries MB | written in place | status |",
        "|---|---|---|---|---|---|---|---|---|"]
for r in report["decode"] + report["decode_model"]:
    mem, state = r.get("decode_xla_mem") or {}, r.get("state_bytes_empty")
    temp = mem.get("temp")
    place = None if temp is None or not state else ("yes" if temp < state / 4 else "no")
    where = f"{r['layers']} layers, scan {r.get('scan_layers')}" if r.get("model") else "core alone"
    body.append(f"| {r.get('method')} | {where} | {r.get('position')} | {r.get('cache_dtype', r.get('state_dtypes', '–'))} | "
                f"{fmt(r['per_token_s'] * 1e3 if r.get('per_token_s') else None)} | "
                f"{fmt(state / 1e6 if state else None)} | {fmt(temp / 1e6 if temp is not None else None)} | "
                f"{place or '–'} | {r.get('status', '')} |")
section("Decoding steps", "decode", body)

Path(base + ".md").write_text("\n".join(md) + "\n")
Path(base + ".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
print(f"report: {base}.md, {base}.json")
bad = [s for s, st in status.items() if st["status"] not in ("ok", "not run")]
if bad:
    print("steps not ok: " + ", ".join(f"{s} ({status[s]['status']})" for s in bad))
sys.exit(1 if bad else 0)
EOF
