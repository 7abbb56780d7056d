"""Are the attention methods' results bit-identical to another commit's? For every method, direction and
implementation that runs here (a Pallas kernel in interpret mode), at the method's first contract case of that
direction (the implementation law's case: ``tests/attention/test_implementations.py``), the outputs, the final
state and the gradients of ``sum(out * w)`` with respect to the parameters, q, k and v, in float32 (or ``--dtype``),
computed in this checkout and in a checkout of ``--base``, then compared exactly.

    python scripts/same_bits.py                      # against HEAD (the uncommitted changes)
    python scripts/same_bits.py --base HEAD~3 --methods eva,fma --dtype bfloat16

The other checkout is a detached ``git worktree`` under the system's temporary folder (removed afterwards); each
tree runs in its own process with its own ``longctx`` on the path, the same runner code in both. Prints one line per
(method, direction, implementation, case): ``same``, ``DIFFERENT`` (with the largest absolute difference and the
first differing array), ``new`` or ``gone``; exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNNER = r'''
import json, sys, warnings
import numpy as np
import jax, jax.numpy as jnp
from flax import nnx
from longctx import attention

out_path, methods, dtype_name = sys.argv[1], sys.argv[2], sys.argv[3]
dtype = jnp.dtype(dtype_name)
methods = [m for m in attention.names() if methods == "all" or m in methods.split(",")]
try:
    from longctx.attention import dispatch
    plat = dispatch.current_platform()
except Exception:
    plat = jax.default_backend()
arrays, index = {}, {}


def runnable(impl):
    return (impl.kernel and plat == "cpu") or plat in impl.platforms


def inputs(case):
    T, H, Dk = case.length, case.num_heads, case.head_dim
    Dv = case.value_dim or Dk
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    return (jax.random.normal(ks[0], (2, H, T, Dk)).astype(dtype), jax.random.normal(ks[1], (2, H, T, Dk)).astype(dtype),
            jax.random.normal(ks[2], (2, H, T, Dv)).astype(dtype), jax.random.normal(ks[3], (2, H, T, Dv)))


def core_run(name, direction, impl, case):
    cfg = attention.default_config(name)
    cfg.update(case.cfg)
    cfg.update({**impl.config, **impl.test_config})
    core = attention.build(name, cfg, num_heads=case.num_heads, head_dim=case.head_dim, value_dim=case.value_dim,
                           causal=direction == "causal", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)

    def loss(params, q, k, v, w):
        out, state = nnx.merge(graphdef, params, rest)(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w), (out, state)

    run = jax.jit(lambda q, k, v, w: jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, q, k, v, w))
    (_, (out, state)), grads = run(*inputs(case))
    return {"out": out, "state": state, "grads": grads}


def model_run(name, direction, impl, case):
    from longctx.config import base_config
    from longctx.models.decoder import build_model
    causal = direction == "causal"
    c = base_config().model
    c.kind, c.causal = ("decoder" if causal else "encoder"), causal
    c.vocab_size, c.d_model, c.num_layers, c.d_ff = 64, 16, 3, 32
    c.num_heads, c.head_dim = case.num_heads, case.head_dim
    c.positions = "rotary"
    if dtype_name != "float32":
        c.dtype = dtype_name
    c.attention.name = name
    c.attention[name] = {**case.cfg, **impl.config, **impl.test_config}
    model = build_model(c, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    k1, k2 = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(k1, (2, case.length), 0, 63)
    important = None if causal else jax.random.bernoulli(k2, 0.15, (2, case.length))

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m(tokens, None if causal else important, deterministic=True)[0]
        w = jnp.cos(jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
        return jnp.sum(logits.astype(jnp.float32) * w), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return {"logits": logits, "grads": grads}


for name in methods:
    cls = attention.get_class(name)
    for direction in ("causal", "bidirectional"):
        causal = direction == "causal"
        if (causal and not cls.supports_causal) or (not causal and not cls.supports_bidirectional):
            continue
        cases = [(cn, c) for cn, c in cls.contract_cases().items() if direction in c.directions
                 and not getattr(c, "slow", False)]
        core_cases = [(cn, c) for cn, c in cases if getattr(c, "level", "core") == "core"][:1]
        model_cases = [] if core_cases else [(cn, c) for cn, c in cases if c.level == "model"][:1]
        for impl in cls.implementations(causal=causal):
            if not runnable(impl):
                continue
            for (cn, case), fn in [(x, core_run) for x in core_cases] + [(x, model_run) for x in model_cases]:
                key = f"{name}/{direction}/{impl.name}/{cn}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        res = fn(name, direction, impl, case)
                except Exception as e:  # noqa: BLE001  (a case one tree cannot run is reported, not fatal)
                    index[key] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                leaves = jax.tree_util.tree_leaves_with_path(res)
                names = []
                for path, x in leaves:
                    if hasattr(x, "dtype"):
                        k = f"{key}|{jax.tree_util.keystr(path)}"
                        arrays[k] = np.asarray(x)
                        names.append(k)
                index[key] = names
                print(key, flush=True)
np.savez(out_path, **{str(i): a for i, a in enumerate(arrays.values())})
json.dump({"index": index, "order": list(arrays)}, open(out_path + ".json", "w"))
'''


def dump(tree: Path, out: Path, methods: str, dtype: str) -> dict:
    runner = out.with_suffix(".runner.py")
    runner.write_text(RUNNER)
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    subprocess.run([sys.executable, str(runner), str(out), methods, dtype], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    meta = json.loads(Path(str(out) + ".json").read_text())
    import numpy as np

    data = np.load(str(out) + ".npz")
    arrays = {k: data[str(i)] for i, k in enumerate(meta["order"])}
    return {"index": meta["index"], "arrays": arrays}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the commit to compare with (default HEAD)")
    ap.add_argument("--methods", default="all", help="comma list of methods (default all)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="same-bits-") as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.base],
                       check=True)
        try:
            old = dump(base, tmp / "old", args.methods, args.dtype)
            new = dump(ROOT, tmp / "new", args.methods, args.dtype)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    differ = 0
    for key in sorted(set(old["index"]) | set(new["index"])):
        a, b = old["index"].get(key), new["index"].get(key)
        if a is None or b is None:
            print(f"{key}: {'new' if a is None else 'gone'}")
            continue
        if isinstance(a, str) or isinstance(b, str):
            print(f"{key}: base {a if isinstance(a, str) else 'ran'}; here {b if isinstance(b, str) else 'ran'}")
            differ += isinstance(b, str) and not isinstance(a, str)
            continue
        bad = []
        for name in sorted(set(a) | set(b)):
            x, y = old["arrays"].get(name), new["arrays"].get(name)
            if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
                bad.append((name.split("|", 1)[1], "missing or reshaped", None))
            elif x.tobytes() != y.tobytes():  # bit for bit (NaNs included; bfloat16 arrays too)
                d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.dtype.kind != "V" else None
                bad.append((name.split("|", 1)[1], "values", d))
        if bad:
            differ += 1
            worst = max((d for *_, d in bad if d is not None), default=None)
            print(f"{key}: DIFFERENT ({len(bad)} arrays; largest |diff| {worst}; first {bad[0][0]}: {bad[0][1]})")
        else:
            print(f"{key}: same ({len(a)} arrays)")
    print(f"{differ} differ" if differ else "all the same bits")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
