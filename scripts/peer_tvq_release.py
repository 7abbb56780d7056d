"""Whole-model training step of the official Transformer-VQ JAX release (the peer) against this
repository's equivalent model, timed interleaved at given sequence lengths.

    git clone https://github.com/transformer-vq/transformer_vq /tmp/tvq-release
    .venv/bin/python scripts/peer_tvq_release.py --release_repo /tmp/tvq-release --release_python /tmp/tvqrel/bin/python \
        --lengths 1k,4k,16k --repeats 5 --warmup 2

What is timed, on each side: one call of the jitted training step -- loss, gradient and optimizer
update, one update per row of T tokens (batch 1, fp32, no dropout) -- wall clock until the new
parameters and the metrics are ready (``block_until_ready``).

* The peer: the release's own ``ops/train.py::train_op`` (``jax.pmap`` over one device, its train
  state donated, so each call continues from the state the previous one returned) with
  ``sequence_len = update_len = T`` and ``global_batch_size = 1``, at the release's model shape:
  d_model 256, ``n_layer=4`` (two GAUs per layer: 8 GAUs), d_k 128, d_v 512, one head, block_len
  256, mem_len 256, 256 codes, 256 byte vocabulary, grad_thru_cache=1, agg_cache=1, pe_abs=0,
  e_tie=0, e_preln=0, e_scale=1.0, c_beta 1e-4, c_gamma 0.99, every dropout rate 0. Parameters come
  from ``Transformer.init`` with the rngs ``params``/``ephemeral``/``timeless``, and the optimizer is
  built the way the release's ``scripts/launch.py`` builds it, with ``scripts/lm_enwik8.sh``'s
  values: ``optax.multi_transform`` with label "codebook" for the parameters whose name starts with
  ``c_`` (plain SGD at rate 1.0: the release's codebook EMA is written as a surrogate loss) and
  "main" for the rest (global-norm clip 0.1, AdamW lr 4e-4, b1 0.9, b2 0.98, eps 1e-9, fp32 moments,
  linear warm-up then cosine schedule, decoupled weight decay 2e-4 on non-vector parameters).
* This repository: ``configs/builtin/transformer_vq.py`` with the overrides in ``OUR_SETS`` (the same
  shape: 8 GAUs, d_model 256, Dk 128, Dv = 2 * 256 = 512, one head, L = M = 256, 256 codes, untied
  output head, no dropout, the release's optimizer constants where this framework has them), built,
  compiled and timed by this repository's step benchmark (``longctx/bench/step_bench.py``:
  ``length_config``, ``build_step``, ``_timed``) with the whole row as one update.

Known differences of the two models (they do not change the amount of work materially): the peer has
no final norm (e_preln=0), this repository's decoder has one; the peer's output head has a bias and
its embedding table carries an unused output bias; the peer keeps the codebook statistics
(``c_sum``, ``c_count``) as parameters updated by SGD on a surrogate loss, this repository keeps them
as non-gradient state updated by the EMA directly (so the parameter counts are printed with and
without them); the peer rematerializes each layer (``nn.remat``), this repository's XLA path uses its
own recomputing backward; the peer's input norm is an RMS norm with gain and bias, like ours.

Protocol. The driver starts one long-lived worker per side (this same file with ``--worker``), the
peer's in the peer's own Python (``--release_python``), this repository's in ours
(``--ours_python``). Each worker first builds and compiles its step for every requested length and
runs ``--warmup`` untimed steps (the compile times are reported; the two workers build one after the
other, so neither compile competes with the other), then the driver alternates single timed steps:
for repeat r, for each length T, one step of the peer and one of ours (the order flips every
repeat). JSON lines on the workers' stdin/stdout; everything else a worker prints goes to stderr.

The peer's source is exported at run time from the bare git checkout ``--release_repo`` (``git
archive HEAD src``) into a temporary folder that is put on the peer worker's ``sys.path``; nothing of
it is copied into this repository. Only ``nn/*`` and ``ops/{train,loss}.py`` are imported (they need
jax, flax, optax, chex and numpy; the data-pipeline modules that need seqio/tensorflow are never
imported, so nothing is stubbed).

The peer's Python environment (the release pins old versions; once):

    python3.11 -m venv /tmp/tvqrel
    /tmp/tvqrel/bin/pip install "jax==0.4.13" "jaxlib==0.4.13" "flax==0.6.11" "optax==0.1.5" \
        "chex==0.1.82" "numpy<2" "scipy<1.12" "ml_dtypes==0.2.0"

Output: a markdown table on stdout, ``DIR/peer_tvq_release.json`` and ``DIR/peer_tvq_release.md`` (``--out DIR``,
default ``results/peer_tvq`` under the working directory). Extra overrides of our config:
``--config.KEY=VALUE`` (repeatable). tokens/s = batch * T / median step time; "ours / release" is the ratio
of the tokens/s (> 1: this repository is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RELEASE_REPO = os.environ.get("TVQ_RELEASE_REPO", "")  # the release's git checkout
DEFAULT_RELEASE_PYTHON = "/tmp/tvqrel/bin/python"
OUR_CONFIG = "configs/builtin/transformer_vq.py"

# The peer's hyper-parameters (TransformerConfig fields); sequence_len and update_len are set to T per length.
RELEASE_HPARAMS = {
    "param_dtype": "float32", "dtype": "float32", "global_batch_size": 1,
    "block_len": 256, "mem_len": 256, "grad_thru_cache": 1, "agg_cache": 1,
    "d_model": 256, "d_k": 128, "d_v": 512, "d_ff": 0, "n_head": 1, "n_code": 256,
    "n_layer": 4,  # two GAUs per layer: 8 GAUs
    "n_vocab": 256, "pe_abs": 0, "pe_lam": 100000,
    "p_dropemb": 0.0, "p_dropsin": 0.0, "p_dropres": 0.0, "p_droplyr": 0.0, "p_nucleus": 0.9,
    "c_beta": 1e-4, "c_gamma": 0.99, "e_tie": 0, "e_preln": 0, "e_scale": 1.0,
}
# The peer's optimizer (launch.py's get_tx with scripts/lm_enwik8.sh's values).
RELEASE_OPTIM = {"grad_clip": 0.1, "lr_max": 4e-4, "b1": 0.9, "b2": 0.98, "eps": 1e-9, "wd_lam": 2e-4,
                 "n_warmup_step": 10000, "n_max_step": 125000, "cosine_alpha": 0.1}

# This repository's equivalent model on top of OUR_CONFIG (--set appends more).
OUR_SETS = [
    "model.d_model=256",
    "model.num_layers=8",  # GAUs
    "model.num_heads=1",
    "model.head_dim=128",
    "model.gau_expansion=2",  # H*Dv = 2 * 256 = 512
    "model.tie_embeddings=False",  # e_tie=0
    "model.dropout=0.0",
    "model.gau_layerdrop=0.0",
    "model.attention.transformer_vq.block_len=256",
    "model.attention.transformer_vq.mem_len=0",  # 0 means M = block_len = 256 (release mem_len 256)
    "model.attention.transformer_vq.codebook_size=256",
    "model.attention.transformer_vq.beta=0.0001",
    "model.attention.transformer_vq.gamma=0.99",
    "model.attention.transformer_vq.p_dropsin=0.0",
    "train.lr=0.0004",
    "train.b1=0.9",
    "train.b2=0.98",
    "train.eps=1e-9",
    "train.grad_clip=0.1",
]


# ============================================================================ workers (JSON lines)
def _protocol_streams():
    """(reader, writer) for the JSON-line protocol; fd 1 is pointed at stderr so that stray prints of
    the libraries cannot corrupt the replies."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin, out


def _reply(out, obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _serve(build, step):
    """Worker loop: {"cmd": "build", ...} -> build(msg); {"cmd": "step", "T": T} -> step(T); "quit"."""
    inp, out = _protocol_streams()
    for line in inp:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        try:
            if cmd == "build":
                _reply(out, {"ok": True, **build(msg)})
            elif cmd == "step":
                _reply(out, {"ok": True, **step(int(msg["T"]))})
            elif cmd == "quit":
                _reply(out, {"ok": True})
                return
            else:
                _reply(out, {"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as e:  # reported to the driver, which marks the length failed
            import traceback

            traceback.print_exc()
            _reply(out, {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})


def release_worker(src: str) -> None:
    """The peer's side; runs in the peer's Python with the exported ``src`` on sys.path."""
    sys.path.insert(0, src)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import jax_utils, traverse_util
    from flax.training.train_state import TrainState
    from transformer_vq.nn.model import Transformer
    from transformer_vq.nn.types import TransformerConfig
    from transformer_vq.nn.vq import VQSpec
    from transformer_vq.ops.train import train_op

    built = {}

    def make_tx(o):
        # launch.py's get_tx(): clip + adamw + schedule + decoupled decay for "main"; SGD(1.0) for the
        # codebook statistics (the parameters named c_*), labelled by name.
        warm = optax.linear_schedule(0.0, 1.0, transition_steps=o["n_warmup_step"])
        cos = optax.cosine_decay_schedule(init_value=1.0, decay_steps=o["n_max_step"] - o["n_warmup_step"],
                                          alpha=o["cosine_alpha"])
        sched = optax.join_schedules([warm, cos], boundaries=[o["n_warmup_step"]])
        main = optax.chain(
            optax.clip_by_global_norm(o["grad_clip"]),
            optax.adamw(learning_rate=o["lr_max"], b1=o["b1"], b2=o["b2"], eps=o["eps"], mu_dtype=jnp.float32,
                        weight_decay=0.0),
            optax.scale_by_schedule(sched),
            optax.add_decayed_weights(weight_decay=-o["wd_lam"],
                                      mask=lambda p: jax.tree_util.tree_map(lambda x: jnp.ndim(x) != 1, p)),
        )

        def labels(tree):
            flat = traverse_util.flatten_dict(tree)
            return traverse_util.unflatten_dict(
                {k: ("codebook" if k[-1].startswith("c_") else "main") for k in flat})

        return optax.multi_transform({"main": main, "codebook": optax.sgd(learning_rate=1.0)}, param_labels=labels)

    def build(msg):
        hp, o, seed, warmup = msg["hparams"], msg["optim"], int(msg.get("seed", 0)), int(msg["warmup"])
        rows, n_params, n_codebook = {}, None, None
        for T in msg["lengths"]:
            try:
                t0 = time.perf_counter()
                cfg = TransformerConfig.create(**hp, sequence_len=T, update_len=T, is_train=True)
                L = cfg.block_len
                if T % L:
                    raise ValueError(f"T={T} must be a multiple of block_len={L}")
                k_init, k_data, k_step = jax.random.split(jax.random.PRNGKey(seed), 3)
                k1, k2, k3 = jax.random.split(k_init, 3)
                params = Transformer(cfg).init(
                    {"params": k1, "ephemeral": k2, "timeless": k3},
                    inputs=jnp.zeros([1, L], jnp.int32), doc_ids=jnp.zeros([1, L], jnp.int32),
                    state=Transformer.initial_state(config=cfg, batch_size=1),
                    vq_spec=VQSpec.create(n_device=jnp.array([1]), n_block_per_update=jnp.array([1]),
                                          loss_mask=jnp.ones([1, L], jnp.int32)),
                )["params"].unfreeze()
                flat = traverse_util.flatten_dict(params)
                n_params = int(sum(np.prod(v.shape) for v in flat.values()))
                n_codebook = int(sum(np.prod(v.shape) for k, v in flat.items() if k[-1].startswith("c_")))
                state = jax_utils.replicate(TrainState.create(apply_fn=None, params=params, tx=make_tx(o)))
                B = cfg.global_batch_size
                tok = jax.random.randint(k_data, (B, T + 1), 0, cfg.n_vocab, dtype=jnp.int32)
                batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "doc_ids": jnp.zeros((B, T), jnp.int32),
                         "loss_mask": jnp.ones((B, T), jnp.int32)}
                batch = jax.tree_util.tree_map(lambda x: x.reshape(1, *x.shape), batch)  # [devices=1, B, T]
                rng = jax.random.split(k_step, 1)  # one key per device
                how = "lower+compile"
                try:
                    fn = train_op.lower(cfg, state, batch, rng).compile()
                except Exception as e:  # then the first call compiles (and also runs one step)
                    print(f"release: AOT compile not available ({type(e).__name__}: {e}); first call compiles",
                          file=sys.stderr)
                    fn = lambda s, b, r, _c=cfg: train_op(_c, s, b, r)  # noqa: E731
                    how = "first call (compile + one step)"
                    state, _ = fn(state, batch, rng)
                    jax.block_until_ready(state.params)
                compile_s = time.perf_counter() - t0
                for _ in range(warmup):
                    state, metrics = fn(state, batch, rng)
                    jax.block_until_ready((state.params, metrics))
                built[T] = {"fn": fn, "state": state, "batch": batch, "rng": rng}
                rows[str(T)] = {"status": "ok", "compile_s": compile_s, "compile_how": how}
            except Exception as e:
                import traceback

                traceback.print_exc()
                rows[str(T)] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        return {"rows": rows, "params": n_params, "params_codebook_stats": n_codebook,
                "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__,
                             "flax": __import__("flax").__version__, "optax": optax.__version__,
                             "python": sys.version.split()[0]},
                "devices": [str(d) for d in jax.devices()]}

    def step(T):
        b = built[T]
        c0, t0 = time.process_time(), time.perf_counter()
        state, metrics = b["fn"](b["state"], b["batch"], b["rng"])
        jax.block_until_ready((state.params, metrics))
        t1, c1 = time.perf_counter(), time.process_time()
        b["state"] = state  # the old one was donated
        loss = float(np.asarray(metrics["loss_lm_per_token_unscaled"]).reshape(-1)[0])
        return {"s": t1 - t0, "cpu_s": c1 - c0, "loss": loss}

    _serve(build, step)


def ours_worker() -> None:
    """This repository's side: the step benchmark's own build and timing functions."""
    sys.path.insert(0, str(REPO))
    from longctx.host_memory import keep_freed_memory

    keep_freed_memory()  # what every longctx entry point does (LONGCTX_HOST_MALLOC=system turns it off)
    import jax
    import numpy as np

    from longctx.bench import common as C
    from longctx.bench import configs, step_bench

    built = {}

    def build(msg):
        base = configs.with_overrides(configs.load_config_file(msg["config"]), msg["sets"])
        ns = argparse.Namespace(batch_size=1, window=0, vocab_size=256)
        rows, n_params, n_nongrad = {}, None, None
        for T in msg["lengths"]:
            try:
                t0 = time.perf_counter()
                cfg = step_bench.length_config(base, T, ns)
                compiled, call_args, mem, n_params = step_bench.build_step(cfg, seed=int(msg.get("seed", 0)))
                compile_s = time.perf_counter() - t0
                n_nongrad = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(call_args[1])))
                for _ in range(int(msg["warmup"])):
                    C.block(compiled(*call_args))
                built[T] = (compiled, call_args)
                rows[str(T)] = {"status": "ok", "compile_s": compile_s, "compile_how": "build_step (build+compile)",
                                "xla_mem_total_bytes": mem.get("total")}
            except Exception as e:
                import traceback

                traceback.print_exc()
                rows[str(T)] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        return {"rows": rows, "params": n_params, "params_codebook_stats": n_nongrad,
                "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
                "devices": [str(d) for d in jax.devices()], "machine": C.machine_info()}

    def step(T):
        compiled, call_args = built[T]
        out = step_bench._timed(compiled, call_args)
        return {"s": out["s"], "cpu_s": out["cpu_s"]}

    _serve(build, step)


# ============================================================================ driver
class Worker:
    def __init__(self, name: str, argv: list[str], env=None):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                     bufsize=1, cwd=str(REPO), env=env)

    def ask(self, msg: dict) -> dict:
        if self.proc.poll() is not None:
            return {"ok": False, "error": f"{self.name} worker exited with code {self.proc.returncode}"}
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait()
            return {"ok": False, "error": f"{self.name} worker died (exit code {self.proc.returncode})"}
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask({"cmd": "quit"})
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()


def parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def fmt_len(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def fmt(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{nd}g}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def markdown(res: dict) -> str:
    rel, our = res["release"], res["ours"]
    lines = [
        f"Whole-model training step (loss + gradient + optimizer update, one update per row, batch 1, fp32) of "
        f"the official Transformer-VQ release (commit `{res['release_commit'][:12]}`, `train_op`) against this "
        f"repository's `{res['ours_config']}` with `{' '.join(res['ours_sets'])}`; "
        f"median of {res['repeats']} interleaved steps after {res['warmup']} warm-up step(s).",
        "",
        f"Host allocator (longctx/host_memory.py): release `{res.get('release_malloc', 'system')}`, ours "
        f"`{res.get('ours_malloc', 'keep')}` (system = the C library's defaults; keep = one arena, no mmap, "
        "no trimming, and transparent huge pages for the heap where glibc and the kernel offer them).",
        "",
        f"Parameters: release {fmt(rel.get('params'))} "
        f"(of which codebook statistics c_sum/c_count {fmt(rel.get('params_codebook_stats'))}; without them "
        f"{fmt(_minus(rel.get('params'), rel.get('params_codebook_stats')))}), ours {fmt(our.get('params'))} trained "
        f"+ {fmt(our.get('params_codebook_stats'))} codebook statistics (non-gradient state).",
        "",
        "| T | release step s | release tokens/s | ours step s | ours tokens/s | ours / release | "
        "release compile s | ours compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append("| " + " | ".join([
            fmt_len(r["T"]), fmt(r["release"].get("step_s")), fmt(r["release"].get("tokens_per_s")),
            fmt(r["ours"].get("step_s")), fmt(r["ours"].get("tokens_per_s")),
            (f"{r['ratio_tokens_per_s']:.2f}x" if r.get("ratio_tokens_per_s") else "-"),
            fmt(r["release"].get("compile_s")), fmt(r["ours"].get("compile_s")),
        ]) + " |")
    errs = [f"- T={fmt_len(r['T'])} {side}: {r[side]['error']}" for r in res["rows"] for side in ("release", "ours")
            if r[side].get("error")]
    if errs:
        lines += ["", "Failures:", *errs]
    return "\n".join(lines) + "\n"


def _minus(a, b):
    return None if a is None or b is None else a - b


def export_release(repo: str, dest: str) -> str:
    """``git archive HEAD src`` of the bare checkout into ``dest``; returns the commit."""
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.Popen(["git", "-C", repo, "archive", "HEAD", "src"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise SystemExit(f"git archive of {repo} failed")
    return commit


# glibc's environment form of longctx.host_memory.settings() (one arena, no mmap at any size, no trimming)
RELEASE_KEEP_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                           "MALLOC_MMAP_THRESHOLD_": str((1 << 64) - 1), "MALLOC_TRIM_THRESHOLD_": str((1 << 64) - 1)}


def with_huge_pages(env: dict) -> dict:
    """``env`` plus glibc's huge-page tunable where longctx's console entry points restart with it
    (longctx.host_memory.huge_pages_env), else ``env`` unchanged."""
    from longctx.host_memory import huge_pages_env

    return huge_pages_env(env) or env


def drive(args) -> dict:
    lengths = parse_lengths(args.lengths)
    if not lengths or args.repeats <= 0 or args.warmup < 0:
        raise SystemExit("give --lengths, --repeats >= 1 and --warmup >= 0")
    if not Path(args.release_python).exists():
        raise SystemExit(f"--release_python {args.release_python} not found; see this script's docstring for the venv")
    tmp = tempfile.mkdtemp(prefix="tvq_release_")
    workers = []
    try:
        commit = export_release(args.release_repo, tmp)
        me = str(Path(__file__).resolve())
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        ours_env = with_huge_pages(env)  # what `longctx-bench step` would run with
        if args.release_malloc == "keep":
            env = with_huge_pages({**env, **RELEASE_KEEP_MALLOC_ENV})
        rel = Worker("release", [args.release_python, me, "--worker", "release", "--release_src",
                                 str(Path(tmp) / "src")], env=env)
        workers.append(rel)
        ours = Worker("ours", [args.ours_python, me, "--worker", "ours"], env=ours_env)
        workers.append(ours)
        sets = OUR_SETS + list(args.set)
        # build one side after the other, so that neither compile competes with the other
        t0 = time.perf_counter()
        rel_info = rel.ask({"cmd": "build", "lengths": lengths, "warmup": args.warmup, "seed": args.seed,
                            "hparams": RELEASE_HPARAMS, "optim": RELEASE_OPTIM})
        print(f"release worker built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        t0 = time.perf_counter()
        our_info = ours.ask({"cmd": "build", "lengths": lengths, "warmup": args.warmup, "seed": args.seed,
                             "config": str(REPO / OUR_CONFIG), "sets": sets})
        print(f"our worker built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for name, info in (("release", rel_info), ("ours", our_info)):
            if not info.get("ok"):
                print(f"{name} worker failed to build: {info.get('error')}", file=sys.stderr)
        print(f"parameters: release {rel_info.get('params')} (codebook stats {rel_info.get('params_codebook_stats')}),"
              f" ours {our_info.get('params')} (+ codebook stats {our_info.get('params_codebook_stats')})",
              file=sys.stderr)
        sides = {"release": (rel, rel_info), "ours": (ours, our_info)}
        samples = {T: {"release": [], "ours": []} for T in lengths}
        errors = {T: {} for T in lengths}
        for side, (_, info) in sides.items():
            for T in lengths:
                row = (info.get("rows") or {}).get(str(T))
                if not info.get("ok") or row is None or row.get("status") != "ok":
                    errors[T][side] = (row or {}).get("error") or info.get("error") or "not built"
        for r in range(args.repeats):
            order = ("release", "ours") if r % 2 == 0 else ("ours", "release")
            for T in lengths:
                for side in order:
                    if side in errors[T]:
                        continue
                    reply = sides[side][0].ask({"cmd": "step", "T": T})
                    if reply.get("ok"):
                        samples[T][side].append(reply)
                    else:
                        errors[T][side] = reply.get("error")
                print(f"repeat {r + 1}/{args.repeats} T={fmt_len(T)}: "
                      + ", ".join(f"{s} {samples[T][s][-1]['s']:.3f} s" for s in order if samples[T][s]
                                  and s not in errors[T]), file=sys.stderr)
        rows = []
        for T in lengths:
            row = {"T": T, "batch_size": 1}
            for side, (_, info) in sides.items():
                built = (info.get("rows") or {}).get(str(T)) or {}
                d = {"compile_s": built.get("compile_s"), "compile_how": built.get("compile_how")}
                if built.get("xla_mem_total_bytes") is not None:
                    d["xla_mem_total_bytes"] = built["xla_mem_total_bytes"]
                s = samples[T][side]
                if side in errors[T]:
                    d["error"] = errors[T][side]
                elif s:
                    med = statistics.median(x["s"] for x in s)
                    d.update(step_s=med, step_s_all=[x["s"] for x in s], tokens_per_s=T / med,
                             cpu_per_wall=statistics.median(x["cpu_s"] / x["s"] for x in s))
                    if "loss" in s[-1]:
                        d["last_loss"] = s[-1]["loss"]
                row[side] = d
            if row["release"].get("tokens_per_s") and row["ours"].get("tokens_per_s"):
                row["ratio_tokens_per_s"] = row["ours"]["tokens_per_s"] / row["release"]["tokens_per_s"]
            rows.append(row)
        strip = ("rows", "ok")
        res = {
            "command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "release_repo": args.release_repo, "release_commit": commit, "release_hparams": RELEASE_HPARAMS,
            "release_optim": RELEASE_OPTIM, "ours_config": OUR_CONFIG, "ours_sets": sets,
            "repeats": args.repeats, "warmup": args.warmup, "lengths": lengths,
            "release_malloc": args.release_malloc, "ours_malloc": os.environ.get("LONGCTX_HOST_MALLOC", "keep"),
            "release": {k: v for k, v in rel_info.items() if k not in strip},
            "ours": {k: v for k, v in our_info.items() if k not in strip},
            "rows": rows,
        }
        return res
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1k,4k,16k", help="comma list of row lengths T (k = 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per length and side (interleaved)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per length and side after compiling")
    ap.add_argument("--out", default="results/peer_tvq", help="folder for peer_tvq_release.json and .md")
    ap.add_argument("--release_python", default=DEFAULT_RELEASE_PYTHON,
                    help="Python of the peer's venv (see the docstring for how to create it)")
    ap.add_argument("--release_repo", default=DEFAULT_RELEASE_REPO, help="git checkout (bare is fine) of the release (default: $TVQ_RELEASE_REPO)")
    default_ours = REPO / ".venv" / "bin" / "python"
    ap.add_argument("--ours_python", default=str(default_ours) if default_ours.exists() else sys.executable,
                    help="Python with this repository installed (default .venv/bin/python)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--release_malloc", choices=("system", "keep"), default="system",
                    help="the peer's host allocator: the C library's defaults (system, as the release ships) or the "
                         "settings this repository's entry points apply (keep; longctx/host_memory.py), given to "
                         "glibc through its environment variables")
    ap.add_argument("--worker", choices=("release", "ours"), help=argparse.SUPPRESS)
    ap.add_argument("--release_src", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
    args = ap.parse_args([a for a in argv if not a.startswith("--config.")])
    args.set = overrides  # extra overrides of our config, after OUR_SETS
    if not args.worker and (not args.release_repo or not os.path.isdir(args.release_repo)):
        ap.error(f"--release_repo {args.release_repo!r}: give a git checkout of the release "
                 "(git clone https://github.com/transformer-vq/transformer_vq)")
    if args.worker == "release":
        release_worker(args.release_src)
        return 0
    if args.worker == "ours":
        ours_worker()
        return 0
    res = drive(args)
    md = markdown(res)
    if args.out:  # always set (default results/peer_tvq)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peer_tvq_release.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "peer_tvq_release.md").write_text(md)
    print(md)
    failed = any(r[s].get("error") for r in res["rows"] for s in ("release", "ours"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
