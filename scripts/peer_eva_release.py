"""Time our EVA attention against the released PyTorch EVA (HKUNLP/efficient-attention), interleaved.

Both sides run the same layer: q/k/v projections of x [T, B, 256] into 4 heads of 64, causal EVA
(window 128, chunk 8, adaptive 'qk' projections, T5-style relative bias, no overlap window), output
projection, both on the training path (the released layer in ``train()``, ours with ``deterministic=False`` and a
key per call: each draws one noise sample per chunk; no attention dropout on either side). Timed: forward, and
forward+backward of sum(out * w) with respect to the input and every parameter, batch 1, fp32, on the CPU
threads of this process. The released code is read from a checkout
(``--release_repo``, a git directory) and put on ``sys.path`` from a temporary export; nothing of it is
kept in this repository. It needs ``torch`` and ``einops`` in the running environment (neither is a
project dependency: ``pip install torch --index-url https://download.pytorch.org/whl/cpu einops``).

    git clone https://github.com/HKUNLP/efficient-attention /tmp/eva-release
    .venv/bin/python scripts/peer_eva_release.py --release_repo /tmp/eva-release --lengths 8k,16k --repeats 9
    .venv/bin/python scripts/peer_eva_release.py --release_repo /tmp/eva-release --no_proj --out results/peer_eva_core

Per length, the calls alternate: released forward, ours forward, released forward+backward, ours
forward+backward, repeated; medians are reported. Writes peer_eva.json and peer_eva.md under --out (default
results/peer_eva, or results/peer_eva_core with --no_proj, relative to the working directory).
Run as a script, the process first takes the host memory settings of longctx's entry points
(``longctx/host_memory.py``: freed memory kept, huge pages for the heap); both sides share them, as
they share the process (``LONGCTX_HOST_MALLOC=system`` leaves glibc's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the release's git checkout: --release_repo, else $EVA_RELEASE_REPO
DEFAULT_REPO = os.environ.get("EVA_RELEASE_REPO", "")


def parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def export_release(repo: str, dest: str) -> str:
    """git archive the released package into dest; returns the folder to put on sys.path."""
    sub = "efficient-attention"
    archive = subprocess.run(["git", "-C", repo, "archive", "HEAD", sub], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return os.path.join(dest, sub)


def release_layer(torch, path: str, d_model: int, heads: int, window: int, chunk: int):
    # The package's __init__ imports every attention variant (and timm); register the package without
    # running it, so only causal_eva.py and attn_utils.py are imported. add_nested_argument serves only
    # its command-line registration, which is not used here.
    pkg = types.ModuleType("efficient_attention")
    pkg.__path__ = [os.path.join(path, "efficient_attention")]
    pkg.add_nested_argument = lambda *a, **k: None
    sys.modules["efficient_attention"] = pkg
    from efficient_attention.causal_eva import CausalEVAttention  # noqa: E402  (the peer under test)

    args = types.SimpleNamespace(window_size=window, overlap_window=False, causal=True, num_chunks=None,
                                 chunk_size=chunk, use_t5_rpe=True, adaptive_proj="qk")
    torch.manual_seed(0)
    return CausalEVAttention(d_model, heads, self_attention=True, attn_args=args)


def drop_projections(layer, torch):
    """--no_proj: the released layer's q/k/v/output projections replaced by identities (d_model = heads x head_dim,
    so every shape stays): what is left is its attention core (adaptive chunk projections, RPE, masks)."""
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        setattr(layer, name, torch.nn.Identity())
    return layer


def our_layer(d_model: int, heads: int, window: int, chunk: int, proj: bool = True):
    """(params, f_fwd, f_grad): projections + our EVA core + output projection, as pure jitted functions
    (``proj=False``: identities in place of the four projections, as :func:`drop_projections`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from longctx import attention
    from longctx.layout import rows_apply

    cfg = attention.default_config("eva")
    cfg.update({"window_size": window, "chunk_size": chunk, "overlap_window": False, "use_rpe": True,
                "adaptive_proj": "qk"})
    D = d_model // heads
    core = attention.build("eva", cfg, num_heads=heads, head_dim=D, causal=True, rngs=nnx.Rngs(0))
    graphdef, core_params, rest = nnx.split(core, nnx.Param, ...)
    ks = jax.random.split(jax.random.key(0), 4)
    proj_params = {n: (jax.random.normal(k, (d_model, d_model)) * d_model ** -0.5, jnp.zeros((d_model,)))
                   for n, k in zip(("q", "k", "v", "o"), ks)} if proj else {}
    params = {"core": core_params, "proj": proj_params}

    def layer(params, x, key):  # x [B, T, d_model]
        B, T, _ = x.shape
        heads_of = lambda y: y.reshape(B, T, heads, D).transpose(0, 2, 1, 3)  # noqa: E731
        # the models' Linear layers (longctx.models.layers.Linear) apply their matmul to [B*T, d]: rows_apply
        lin = (lambda y, n: rows_apply(lambda z: z @ params["proj"][n][0] + params["proj"][n][1], y)) if proj \
            else (lambda y, n: y)  # noqa: E731
        q, k, v = (heads_of(lin(x, n)) for n in ("q", "k", "v"))
        # the training path, as the released layer's train(): one noise sample per chunk, drawn in every call
        # from the key argument (no attention dropout is configured on either side)
        o, _ = nnx.merge(graphdef, params["core"], rest)(q, k, v, deterministic=False, key=key)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, d_model)
        return lin(o, "o")

    f_fwd = jax.jit(layer)
    f_grad = jax.jit(jax.grad(lambda p, x, w, key: jnp.sum(layer(p, x, key) * w), argnums=(0, 1)))
    return params, f_fwd, f_grad


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4k,8k,16k")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gap_s", type=float, default=0.0,
                   help="idle seconds before each timed call (lets the other side's worker threads stop spinning)")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--no_proj", action="store_true",
                   help="both sides without their q/k/v/output projections (identities): the attention cores alone")
    p.add_argument("--release_repo", default=DEFAULT_REPO,
                   help="git checkout of HKUNLP/efficient-attention (default: $EVA_RELEASE_REPO)")
    p.add_argument("--out", default=None, help="default results/peer_eva (--no_proj: results/peer_eva_core)")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = "results/peer_eva_core" if a.no_proj else "results/peer_eva"
    if not a.release_repo or not os.path.isdir(a.release_repo):
        p.error(f"--release_repo {a.release_repo!r}: give a git checkout of the release "
                "(git clone https://github.com/HKUNLP/efficient-attention)")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    tmp = tempfile.mkdtemp(prefix="peer_eva_")
    theirs = release_layer(torch, export_release(a.release_repo, tmp), a.d_model, a.heads, a.window, a.chunk)
    if a.no_proj:
        drop_projections(theirs, torch)
    theirs.train()  # the training path (their noise on the chunk projections); no dropout configured
    params, f_fwd, f_grad = our_layer(a.d_model, a.heads, a.window, a.chunk, proj=not a.no_proj)
    n_theirs = sum(x.numel() for x in theirs.parameters())
    n_ours = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"parameters: released {n_theirs:,}  ours {n_ours:,}", flush=True)

    rows = []
    for T in [parse_len(s) for s in a.lengths.split(",")]:
        rng = np.random.default_rng(T)
        x_np = rng.standard_normal((1, T, a.d_model)).astype(np.float32)
        w_np = rng.standard_normal((1, T, a.d_model)).astype(np.float32)
        xt = torch.from_numpy(x_np.transpose(1, 0, 2).copy()).requires_grad_(True)  # [T, B, C]
        wt = torch.from_numpy(w_np.transpose(1, 0, 2).copy())
        xj, wj, key = jnp.asarray(x_np), jnp.asarray(w_np), jax.random.key(T)

        def t_fwd(xt=xt):
            with torch.no_grad():
                theirs(xt, xt, xt)

        def t_bwd(xt=xt, wt=wt):
            theirs.zero_grad(set_to_none=True)
            xt.grad = None
            out, _ = theirs(xt, xt, xt)
            (out * wt).sum().backward()

        def o_fwd(xj=xj, key=key):
            jax.block_until_ready(f_fwd(params, xj, key))

        def o_bwd(xj=xj, wj=wj, key=key):
            jax.block_until_ready(f_grad(params, xj, wj, key))

        calls = {"released fwd": t_fwd, "ours fwd": o_fwd, "released fwd+bwd": t_bwd, "ours fwd+bwd": o_bwd}
        for fn in calls.values():  # compile / warm up
            for _ in range(a.warmup):
                fn()
        times = {k: [] for k in calls}
        for _ in range(a.repeats):
            for k, fn in calls.items():
                time.sleep(a.gap_s)
                times[k].append(timed(fn))
        med = {k: float(np.median(v)) for k, v in times.items()}
        row = {"T": T, **{f"{k} s": v for k, v in med.items()}, "times": times,
               "speedup fwd": med["released fwd"] / med["ours fwd"],
               "speedup fwd+bwd": med["released fwd+bwd"] / med["ours fwd+bwd"],
               "ours bwd/fwd": (med["ours fwd+bwd"] - med["ours fwd"]) / med["ours fwd"],
               "released bwd/fwd": (med["released fwd+bwd"] - med["released fwd"]) / med["released fwd"]}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "times"}),
              flush=True)

    lines = ["| T | released fwd ms | ours fwd ms | released fwd+bwd ms | ours fwd+bwd ms | speed-up fwd | "
             "speed-up fwd+bwd | ours bwd/fwd | released bwd/fwd |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['T'] // 1024}k | {r['released fwd s'] * 1e3:,.0f} | {r['ours fwd s'] * 1e3:,.0f} | "
                     f"{r['released fwd+bwd s'] * 1e3:,.0f} | {r['ours fwd+bwd s'] * 1e3:,.0f} | "
                     f"x{r['speedup fwd']:.2f} | x{r['speedup fwd+bwd']:.2f} | {r['ours bwd/fwd']:.2f} | "
                     f"{r['released bwd/fwd']:.2f} |")
    md = "\n".join(lines)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv, "parameters_released": n_theirs, "parameters_ours": n_ours,
            "torch": torch.__version__, "jax": jax.__version__}
    (out / "peer_eva.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "peer_eva.md").write_text(md + "\n")


if __name__ == "__main__":
    from longctx.host_memory import keep_freed_memory, restart_with_huge_pages

    restart_with_huge_pages()
    keep_freed_memory()
    main()
