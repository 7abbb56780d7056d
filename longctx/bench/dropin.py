"""Training-free "drop-in" settings for the quality benchmark: how a method with learned
parts is compared with exact softmax attention on the same q, k, v without training.

Each method declares its setting through ``AttentionCore.drop_in()`` (see
``longctx.attention.base.DropIn``):

* a method that declares one runs in that setting;
* a parameter-free method (no ``nnx.Param``) runs as it is;
* any other method with learned parts is reported as 'n/a' with the reason (no mode is
  invented for it).

The ``dropin`` sub-command (``longctx-bench dropin``): a method dropped into every layer of a trained model whose layers run exact attention
(an imported Hugging Face model, say), training-free, as KDEformer's paper uses its estimator.

    longctx-bench dropin --workdir runs/llama_tiny --method kdeformer --out results/dropin

On rows of real text (default: this repository's README.md and docs/, tokenized by the run's own tokenizer):
per layer, the relative error ||method - exact|| / ||exact|| of the attention output, both computed on the same
q, k, v -- those of the exact model, so each layer's error is its own, not compounded from the layers below --
and the model's bits per byte with exact attention and with the method in every layer. Writes dropin.json and
dropin.md into --out. ``--config.model.attention.<method>.KEY=VALUE`` sets the method's settings.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from absl import flags

from longctx import attention
from longctx import config as config_lib
from longctx.attention.base import DropIn
from longctx.bench import common as C
from longctx.bench import configs
from longctx.bench.cores import build_core, has_params
from longctx.data.hf import HFTokenizer
from longctx.data.tokenizers import ByteTokenizer
from longctx.errors import ConfigError
from longctx.models.blocks import layer_methods
from longctx.models.decoder import build_model
from pallas_kernels.precision import statistic


def resolve(method: str, overrides: dict, *, heads: int, head_dim: int, causal: bool) -> tuple[DropIn | None, str]:
    """(DropIn, description) or (None, reason it is n/a). Raises ConfigError for an unsupported direction."""
    d = attention.get_class(method).drop_in()
    if d is not None:
        return DropIn(d.description, {**overrides, **d.overrides}, d.setup), d.description
    core = build_core(method, overrides, heads=heads, head_dim=head_dim, causal=causal)
    if not has_params(core):
        return DropIn("parameter-free: used as is", dict(overrides)), "parameter-free: used as is"
    return None, ("n/a: the method has learned parameters and no training-free drop-in setting "
                  "(declare one with AttentionCore.drop_in())")


# ---- ``longctx-bench dropin``: a method swapped into every layer of a trained model, without training



LN2 = math.log(2.0)


REQUIRED = ("workdir", "method")  # flags without a default


def define_flags(fv) -> None:
    flags.DEFINE_string("workdir", None, "a trained or imported run whose every layer runs exact attention "
                        "(required)", flag_values=fv)
    flags.DEFINE_string("method", None, "the method dropped into every layer (e.g. the training-free one; "
                        "required)", flag_values=fv)
    flags.DEFINE_string("text", "", "comma list of text files or folders (their *.md, *.txt, *.py); default: "
                        "README.md and docs/ of this repository", flag_values=fv)
    flags.DEFINE_integer("seq_len", 0, "tokens per row (default: the run's train.seq_len)", flag_values=fv)
    flags.DEFINE_integer("rows", 8, "rows of text scored", flag_values=fv)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)", flag_values=fv)


def validate(args) -> None:
    if args.rows < 1 or args.seq_len < 0:
        raise ConfigError(f"--rows {args.rows} / --seq_len {args.seq_len}: rows >= 1, seq_len >= 0 (0: the run's)")
    if args.method not in attention.names():
        raise ConfigError(f"--method {args.method!r}: registered: {', '.join(attention.names())}")
    bad = [o for o in args.overrides if not o.startswith((f"model.attention.{args.method}.",
                                                         f"execution.attention.{args.method}."))]
    if bad:
        raise ConfigError(f"longctx-bench dropin: --config.{bad[0]}: only the method's own settings "
                          f"(model.attention.{args.method}.*, execution.attention.{args.method}.*) apply")


def text_files(spec: str) -> list[Path]:
    if spec:
        roots = [Path(s.strip()) for s in spec.split(",") if s.strip()]
    else:
        repo = Path(__file__).resolve().parents[2]
        roots = [repo / "README.md", repo / "docs"]
    files = []
    for r in roots:
        if r.is_dir():
            files += sorted(f for f in r.rglob("*") if f.suffix in (".md", ".txt", ".py") and f.is_file())
        elif r.is_file():
            files.append(r)
        else:
            raise ConfigError(f"--text: {r} is neither a file nor a folder")
    if not files:
        raise ConfigError(f"--text {spec!r}: no text files found")
    return files


def token_rows(tokenizer, files: list[Path], seq_len: int, rows: int):
    """([rows, seq_len + 1] token ids, [rows] UTF-8 bytes of the text each row's predicted tokens cover): each
    file is tokenized alone; a row is seq_len + 1 consecutive tokens of one file, the files taken in turn until
    ``rows`` rows are cut. The bytes of a row: from the end of its first token to the end of its last (a Hugging
    Face tokenizer's offsets), or one byte per token (a byte tokenizer)."""

    out_ids, out_bytes = [], []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if getattr(tokenizer, "one_token_per_byte", False):
            ids = np.asarray(tokenizer.encode(text.encode("utf-8")))
            ends = np.arange(1, len(ids) + 1)
            data = None
        elif hasattr(tokenizer, "tok"):  # longctx.data.hf.HFTokenizer
            enc = tokenizer.tok.encode(text, add_special_tokens=False)
            ids = np.asarray(enc.ids)
            data = text
            ends = np.asarray([e for _, e in enc.offsets])
        else:
            raise ConfigError(f"longctx-bench dropin: tokenizer {type(tokenizer).__name__} gives no byte offsets; "
                              "bits per byte need a byte or a Hugging Face tokenizer")
        for s in range(0, len(ids) - seq_len, seq_len + 1):
            out_ids.append(ids[s: s + seq_len + 1])
            a, b = int(ends[s]), int(ends[s + seq_len])
            out_bytes.append(b - a if data is None else len(data[a:b].encode("utf-8")))
            if len(out_ids) == rows:
                return np.stack(out_ids).astype(np.int32), np.asarray(out_bytes)
    raise ConfigError(f"longctx-bench dropin: the text gives {len(out_ids)} rows of {seq_len + 1} tokens, "
                      f"fewer than --rows={rows}; give more text (--text) or fewer rows")


def run_tokenizer(runner):
    """The run's tokenizer: a Hugging Face tokenizer.json or bytes built directly (no corpus needed), any other
    the way longctx-eval loads it (from the run's prepared data)."""
    data = runner.cfg.data
    if data.tokenizer == "hf":
        return HFTokenizer(data.options.get("tokenizer_file", ""), data.options.get("eos_token", ""))
    if data.tokenizer == "bytes":
        return ByteTokenizer()
    return runner.load_tokenizer(progress=False)


def _probe_class():
    from flax import nnx

    class Probe(nnx.Module):
        """A layer's core for the per-layer error: the method and exact attention on the same q, k, v; reports
        the squared norms of their difference and of the exact output, and hands the exact output on."""

        def __init__(self, inner, exact):
            self.inner, self.exact = inner, exact
            self.name, self.causal = inner.name, inner.causal

        def __call__(self, q, k, v, state=None, *, deterministic=True, key=None, aux=None, **kwargs):
            out, _ = self.inner(q, k, v, None, deterministic=True, key=key, aux=None, **kwargs)
            ref, state = self.exact(q, k, v, state, deterministic=True, aux=None, **kwargs)
            with statistic("drop-in error norms"):
                import jax.numpy as jnp

                d = out.astype(jnp.float32) - ref.astype(jnp.float32)
                if aux is not None:
                    aux.add_metric("err_sq", jnp.sum(d * d))
                    aux.add_metric("ref_sq", jnp.sum(jnp.square(ref.astype(jnp.float32))))
            return ref, state

    return Probe


def nll_sums(model, rows) -> np.ndarray:
    """[rows] the summed next-token NLL (nats, float32) of each row under ``model``."""
    import jax
    import jax.numpy as jnp

    logits, _, _ = model(jnp.asarray(rows[:, :-1]), deterministic=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(rows[:, 1:])[..., None], axis=-1)[..., 0]
    return np.asarray(jnp.sum(nll, axis=-1))


def run(args) -> dict:
    from flax import nnx

    from longctx.runtime import Runner  # deferred: bench --help start-up: no orbax

    runner = Runner.from_workdir(args.workdir, step=args.step, overrides={"model.scan_layers": "off"})  # per layer
    cfg = runner.cfg
    if cfg.model.kind != "decoder":
        raise ConfigError("longctx-bench dropin: bits per byte are scored for a decoder; the run is an encoder")
    methods = layer_methods(cfg.model)
    if any(not attention.get_class(m).exact for m in methods):
        raise ConfigError(f"longctx-bench dropin: the run's layers run {sorted(set(methods))}; the drop-in starts "
                          "from a model whose every layer is exact")
    # the run's config over the base one (its saved config keeps only the sections its methods read)
    swapped = config_lib.merge_over_base(cfg.to_dict())
    swapped.model.attention.name, swapped.model.attention.pattern = args.method, ()
    swapped.model.scan_layers = "off"
    swapped = config_lib.validate(configs.with_overrides(swapped, args.overrides))
    model = build_model(swapped.model, seed=cfg.train.seed, execution=swapped.execution)
    exact_model = runner.model()
    params = nnx.state(exact_model, nnx.Param)
    if len(nnx.to_flat_state(nnx.state(model, nnx.Param))) != len(nnx.to_flat_state(params)):
        raise ConfigError(f"longctx-bench dropin: {args.method} has learned parameters of its own; it cannot "
                          "replace exact attention without training (train.task='attention_transfer')")
    nnx.update(model, params)

    seq_len = args.seq_len or int(cfg.train.seq_len)
    files = text_files(args.text)
    rows, nbytes = token_rows(run_tokenizer(runner), files, seq_len, args.rows)

    before = nll_sums(exact_model, rows)
    after = nll_sums(model, rows)
    Probe = _probe_class()
    for blk, ex in zip(model.blocks, exact_model.blocks):
        blk.core = Probe(blk.core, ex.core)
    _, _, aux = model.hidden(rows[:, :-1], None, deterministic=True)
    m = {k: float(v) for k, v in aux["metrics"].items()}
    layers = [{"layer": i, "method": args.method,
               "rel_error": math.sqrt(m[f"layer{i}/err_sq"] / max(m[f"layer{i}/ref_sq"], 1e-30))}
              for i in range(len(model.blocks))]
    total_bytes = int(nbytes.sum())
    res = {
        "header": C.header(args, "dropin"),
        "method": args.method,
        "settings": swapped.model.attention[args.method].to_dict(),
        "workdir": str(args.workdir), "rows": int(rows.shape[0]), "seq_len": seq_len,
        "tokens_scored": int(rows.shape[0] * seq_len), "bytes_scored": total_bytes,
        "text_files": len(files),
        # a tokenizer whose vocabulary misses the text (the tiny fixture's: <unk> nearly everywhere) shows here
        "top_token_share": float(np.bincount(rows[:, 1:].ravel()).max() / rows[:, 1:].size),
        "bits_per_byte_exact": float(before.sum() / LN2 / total_bytes),
        "bits_per_byte_dropin": float(after.sum() / LN2 / total_bytes),
        "bits_per_token_exact": float(before.sum() / LN2 / rows[:, 1:].size),
        "bits_per_token_dropin": float(after.sum() / LN2 / rows[:, 1:].size),
        "layers": layers,
    }
    out = C.out_dir(args.out)
    C.write_json(out / "dropin.json", res)
    (out / "dropin.md").write_text(markdown(res))
    print(markdown(res))
    return res


def markdown(res: dict) -> str:
    rows = [[r["layer"], r["method"], r["rel_error"]] for r in res["layers"]]
    a = res["header"]["args"]
    cmd = " ".join([f"longctx-bench dropin --workdir {res['workdir']} --method {res['method']} --rows {res['rows']}",
                    f"--seq_len {res['seq_len']}", *([f"--text {a['text']}"] if a.get("text") else []),
                    *(f"--config.{o}" for o in a.get("overrides", []))])
    return (f"## Drop-in: {res['method']} in every layer, without training\n\n`{cmd}`\n\n"
            f"Run `{res['workdir']}`: {res['rows']} rows of {res['seq_len']} tokens of text "
            f"({res['text_files']} files, {res['bytes_scored']:,} bytes scored; the most frequent token is "
            f"{100 * res['top_token_share']:.1f}% of the scored ones). Per layer, the relative error "
            "||method - exact|| / ||exact|| of the attention output on the exact model's q, k, v:\n\n"
            + C.md_table(["layer", "method", "relative error"], rows)
            + "\n" + C.md_table(["attention", "bits per byte", "bits per token"], [
                ["exact", res["bits_per_byte_exact"], res["bits_per_token_exact"]],
                [f"{res['method']} (every layer)", res["bits_per_byte_dropin"], res["bits_per_token_dropin"]]])
            + f"\nSettings: `{res['settings']}`\n")
