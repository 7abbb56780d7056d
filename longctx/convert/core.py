"""Hugging Face folder <-> longctx run.

``import_hf``: a local Hugging Face folder of a supported family (``config.json``, ``*.safetensors``, possibly
sharded with ``model.safetensors.index.json``, and ``tokenizer.json``) -> a longctx run folder: one checkpoint at
step 0 written by :mod:`longctx.train.checkpoint` (params, non-gradient state and a fresh optimizer state, so
``longctx-train`` resumes it), ``config.json`` (the resolved config, as ``longctx-train`` writes it), ``config.py``
(the same config as a config file, for ``longctx-train --config=WORKDIR/config.py --workdir=WORKDIR``),
``tokenizer.json`` (copied; ``data.tokenizer='hf'`` points at it) and ``hf_config.json`` (the source's config).

``export_hf``: a run's newest valid checkpoint (or ``step``) -> ``config.json`` + ``model.safetensors`` (float32,
or the run's parameter dtype) that ``transformers`` loads, plus the run's ``tokenizer.json`` when it has one.

Tensors are read one at a time from the files' memory maps and written one at a time, so a model is held in host
memory once (as the run's parameters), never twice.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from longctx import attention, config_files
from longctx import config as config_lib
from longctx.convert import families
from longctx.convert.errors import ConvertError
from longctx.convert.safetensors import Folder, write
from longctx.errors import ConfigError
from longctx.models.backbone import relayout, scans_layers
from longctx.models.blocks import get_block, layer_config, layer_methods, takes_rotary
from longctx.models.decoder import build_model, with_execution
from longctx.runtime import Runner
from longctx.train import checkpoint, dry_run
from longctx.train.optim import make_optimizer
from longctx.train.step import split_model, with_loss_scale


def read_hf_config(hf_dir: Path) -> dict:
    if not hf_dir.exists():
        raise ConvertError(f"--hf_dir {hf_dir} does not exist; point it at a local Hugging Face model folder "
                           "(config.json, *.safetensors, tokenizer.json)")
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf_dir {hf_dir} is not a folder; point it at a local Hugging Face model folder")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir} has no config.json; is it a Hugging Face model folder?")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path} is not readable JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} is not a JSON object")
    return hf


def exact_method() -> str:
    """The attention method that computes exact softmax attention (the capability ``exact``): what
    ``transformers`` computes, so the one an import builds and an export requires."""

    return next(n for n in attention.names() if attention.get_class(n).exact)


def hf_model_config(hf: dict, base=None, log=None):
    """The longctx config of a ``config.json``: ``base`` (default: the base config) with the model keys the
    family sets. Attention: ``base``'s ``model.attention.pattern`` where it names one (the swap: chosen layers run
    another method, :func:`load_params`; ``attention.name`` becomes the pattern's first other method unless it is
    in the pattern), else ``base``'s ``model.attention.name`` in every layer (by default the exact method)."""

    fam = families.family_of(hf.get("model_type"))
    cfg = config_lib.base_config() if base is None else base
    defaults = config_lib.base_config().model
    for k in families.ARCHITECTURE_KEYS:  # what a family leaves unset is the default, whatever the given config says
        cfg.model[k] = defaults[k]
    for k, v in fam.model_keys(hf).items():
        cfg.model[k] = v
    cfg.model.output = config_lib.base_config().model.output  # the full softmax over the vocabulary
    if cfg.model.kind == "encoder" and cfg.eval.max_bytes > 0 and not cfg.eval.max_tokens:
        (log or (lambda *_: None))(f"note: eval.max_bytes {cfg.eval.max_bytes} -> eval.max_tokens "
                                   f"{cfg.eval.max_bytes}: an encoder is scored on whole rows of tokens")
        cfg.eval.max_tokens, cfg.eval.max_bytes = cfg.eval.max_bytes, 0
    exact = exact_method()
    config_lib._resolve_pattern(cfg)  # a pattern from the command line ('dense,eva') arrives as one string
    pattern = tuple(cfg.model.attention.pattern)
    if pattern and cfg.model.attention.name not in pattern:
        cfg.model.attention.name = next((p for p in pattern if p != exact), exact)
    if len(set(pattern)) == 1:
        cfg.model.attention.name, pattern = pattern[0], ()
    cfg.model.attention.pattern = pattern
    check_positions(hf, cfg)
    if cfg.model.positions == "learned" and cfg.train.seq_len > cfg.model.max_len:
        (log or (lambda *_: None))(f"note: train.seq_len {cfg.train.seq_len} -> {cfg.model.max_len}, the model's "
                                   "learned positions")
        cfg.train.seq_len = cfg.model.max_len
    return fam, cfg


def check_positions(hf: dict, cfg) -> None:
    """Refuse, in one line that names a way that works, attention no layer of which can take the positions
    config.json gives: the import sets ``model.positions`` from config.json, so the validation's advice
    (``--config.model.positions=...``) would be overridden. A rotary model takes such a method in a pattern whose
    exact layers keep the rotation (the method's layers run unrotated: :func:`longctx.models.blocks.takes_rotary`)."""
    m = cfg.model
    try:
        methods = tuple(dict.fromkeys(layer_methods(m)))
    except ConfigError:  # an unknown method or a pattern that does not fit the depth: the validation says which
        return
    known = set(attention.names())
    refused = [n for n in methods if n in known and attention.get_class(n).allowed_positions is not None
               and m.positions not in attention.get_class(n).allowed_positions]
    if not refused or (m.positions == "rotary" and all(n in known for n in methods)
                       and any(takes_rotary(n) for n in methods)):
        return
    name, mt = refused[0], hf.get("model_type")
    said = (f"attention {name!r} takes {', '.join(attention.get_class(name).allowed_positions)} positions, and an "
            f"import takes a {mt} model's from its config.json ({m.positions}; --config.model.positions is "
            "overridden)")
    if m.positions == "rotary":
        exact = exact_method()
        raise ConvertError(f"{said}: run {name} in a pattern whose {exact} layers keep the rotary positions, e.g. "
                           f"--config.model.attention.pattern={exact},{name} (layers alternate, {name} unrotated)")
    raise ConvertError(f"{said}: attention {name!r} cannot run in this model; choose another method")


def check_tokenizer(cfg, tokenizer_file: Path | None) -> None:
    """Refuse, in one line, a tokenizer whose ids do not fit the model's vocabulary (config.json's ``vocab_size``),
    or an encoder's with no mask id (its own ``<mask>`` / ``[MASK]``, or an id beyond its vocabulary): what
    training would refuse later (:func:`longctx.config.resolve_vocab`). ``cfg``: the run's validated config;
    ``tokenizer_file``: the folder's ``tokenizer.json`` (None: the run keeps the config's tokenizer). A
    tokenizer that learns its vocabulary from the data (``words``) is not checked."""
    probe = copy.deepcopy(cfg.to_dict())
    probe["model"]["vocab_size"] = 0  # the tokenizer's own size, not the model's
    if tokenizer_file is not None:
        probe["data"]["options"]["tokenizer_file"] = str(tokenizer_file.resolve())
    elif probe["data"]["tokenizer"] == "words":
        return
    n, mask = dry_run.known_vocab(ml_collections.ConfigDict(probe))
    V = int(cfg.model.vocab_size)
    which = ("its tokenizer.json" if tokenizer_file is not None else
             f"data.tokenizer={cfg.data.tokenizer!r} (the folder has no tokenizer.json)")
    if n > V:
        raise ConvertError(f"the run's tokenizer, {which}, has {n} ids; the model's vocabulary (config.json's "
                           f"vocab_size) has {V}: put the model's own tokenizer.json in the folder, or set "
                           "--config.data.tokenizer to one whose ids fit")
    try:
        config_lib.resolve_vocab(cfg, n, mask_token=mask)
    except ConfigError as e:
        raise ConvertError(f"the run's tokenizer, {which} ({n} ids), does not fit the model: {e}") from None


def check_tensors(fam, m, folder: Folder) -> list:
    """The family's entries for the model ``m``, every Hugging Face tensor present with its shape; raises one
    line naming the first missing or mis-shaped tensor, or a tensor the model has no place for."""
    folder.rename(fam.rename(folder.names(), m))
    entries = fam.entries(m)
    used = set()
    for e in entries:
        for name, shape in zip(e.names, e.shapes):
            if name not in folder:
                raise ConvertError(f"tensor {name} is missing from the safetensors files; the config.json "
                                   f"({m.num_layers} layers, tie_word_embeddings={m.tie_embeddings}) needs it")
            got = tuple(folder.shape(name))
            if got != tuple(shape):
                raise ConvertError(f"tensor {name} has shape {list(got)}; the config.json implies {list(shape)}")
            used.add(name)
    extra = [n for n in folder.names() if n not in used and not n.endswith(fam.ignored_suffixes)
             and not (m.tie_embeddings and n == "lm_head.weight")]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConvertError(f"tensor {extra[0]}{more} has no place in a {fam.name} model of this config.json; the "
                           "folder holds another architecture")
    return entries


def abstract_model(cfg):
    """(graphdef, abstract params, abstract non-gradient state, rest) of the unrolled model of ``cfg``."""
    from flax import nnx

    m = cfg.model.copy_and_resolve_references()
    m.scan_layers = "off"
    model = nnx.eval_shape(lambda: build_model(m, seed=cfg.train.seed, execution=cfg.get("execution")))
    return split_model(model)


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    else:
        yield prefix


def load_params(fam, cfg, folder: Folder):
    """The model's parameters (an ``nnx.State``, unrolled layout) filled from ``folder``, tensor by tensor; and
    the split model (graphdef, params, nongrad, rest). A layer whose method is not the exact one (the swap) takes
    the same tensors (its block's projections, MLP and norms); its core's own parameters and non-gradient state
    (EVA's, FMA's projections, Transformer-VQ's codebook, ...) are the method's initial values (:func:`_fresh`)."""
    from flax import nnx

    entries = check_tensors(fam, cfg.model, folder)
    graphdef, params, nongrad, rest = abstract_model(cfg)
    pure = nnx.to_pure_dict(params)
    filled = set()
    for e in entries:
        want = _get(pure, e.path)
        x = e.join([folder.get(n) for n in e.names], np.dtype(want.dtype))
        if x.shape != tuple(want.shape):  # the family's table and the model disagree: a bug, not an input error
            raise AssertionError(f"{'/'.join(map(str, e.path))}: built {x.shape}, the model has {want.shape}")
        _set(pure, e.path, jnp.asarray(x))
        filled.add(e.path)
    left = [p for p in _paths(pure) if p not in filled]
    pure_nongrad = nnx.to_pure_dict(nongrad)
    fresh = _fresh(cfg, {p[1] for p in [*left, *_paths(pure_nongrad)] if p[:1] == ("blocks",)})
    for p in left:
        if p[:1] == ("blocks",) and p[1] in fresh and p[2] == "core":
            _set(pure, p, _get(fresh[p[1]][0], p[2:]))
        else:
            raise ConvertError(f"the longctx model has parameter {'/'.join(map(str, p))}, which no {fam.name} "
                               "tensor fills")
    for p in _paths(pure_nongrad):
        if p[:1] != ("blocks",) or p[1] not in fresh:
            raise ConvertError(f"the longctx model has state {'/'.join(map(str, p))}, which an import cannot fill")
        _set(pure_nongrad, p, _get(fresh[p[1]][1], p[2:]))
    nnx.replace_by_pure_dict(params, pure)
    nnx.replace_by_pure_dict(nongrad, pure_nongrad)
    return graphdef, params, nongrad, rest


def _fresh(cfg, layers) -> dict:
    """{layer: (its parameters, its non-gradient state)} as pure dicts, of each of ``layers`` that runs a method
    other than the exact one: the block built alone, as the model builds it (seed ``train.seed`` + the layer), so
    its core's values are the method's initialisation. One block at a time in host memory."""
    from flax import nnx

    m = with_execution(cfg.model, cfg.get("execution"))
    methods, exact = _layer_methods(m), exact_method()
    out = {}
    for i in sorted(layers):
        if methods[i] == exact:
            continue
        block = get_block(m.block)(layer_config(m, i), layer_index=i, rngs=nnx.Rngs(int(cfg.train.seed) + i))
        _, p, ng, _ = split_model(block)
        out[i] = (nnx.to_pure_dict(p), nnx.to_pure_dict(ng))
    return out


def _quoted(text: str) -> str:
    """``text`` as a Python literal: a raw triple-quoted block where it can be, else its repr."""
    return repr(text) if "'''" in text or text.endswith("\\") else f"r'''{text}'''"


def _config_py(cfg) -> str:
    return ('"""The config of a run imported by longctx-convert: longctx-train --config=THIS_FILE --workdir=RUN '
            'resumes it."""\n\nimport json\n\nfrom longctx import config as config_lib\n\n'
            f"CONFIG = json.loads({_quoted(cfg.to_json(indent=1))})\n\n\n"
            "def get_config(arg=None):\n    return config_lib.merge_over_base(CONFIG)\n")


def extend_positions(cfg, factor: int, seq_len: int, log=print):
    """``cfg`` (the import's config, learned positions) with ``factor`` times the positions (``model.max_len``)
    and ``train.seq_len`` = ``seq_len`` (the config's own, at most the new length): the longer table is the
    source's learned rows copied ``factor`` times (Longformer's and VCC's initialisation), the offset rows of a
    RoBERTa kept in front (:func:`extended_table`)."""
    if cfg.model.positions != "learned":
        raise ConvertError(f"--extend_positions: the model has {cfg.model.positions} positions; copying applies to "
                           "learned ones (a rotary model runs at any length: --rope_theta gives it a larger base)")
    if factor < 1:
        raise ConvertError(f"--extend_positions={factor} must be an integer >= 1")
    ext = copy.deepcopy(cfg)
    ext.model.max_len = cfg.model.max_len * factor
    ext.train.seq_len = min(seq_len, ext.model.max_len)
    log(f"note: learned positions {cfg.model.max_len} -> {ext.model.max_len} (--extend_positions={factor}: the "
        f"source's rows copied {factor} times), train.seq_len {ext.train.seq_len}")
    return ext


def extended_table(table, factor: int, offset: int):
    """A learned position table [offset + P, d] -> [offset + factor * P, d]: the first ``offset`` rows (RoBERTa's
    padding rows) as they are, then the P learned rows ``factor`` times over, so position p reads the source's
    row p mod P (p < P: the source's model exactly)."""
    return jnp.concatenate([table[:offset], jnp.tile(table[offset:], (factor, 1))], axis=0)


def run_config(hf_dir: Path, config=None, *, rope_theta: float | None = None, extend: int = 1, log=print):
    """(config.json as a dict, the family, the run's config, the source's config) of an import of ``hf_dir`` with
    ``config`` (see :func:`import_hf`); reads config.json only."""

    hf = read_hf_config(hf_dir)
    base = config_files.load(config) if isinstance(config, str) else copy.deepcopy(config)
    want_len = int(base.train.seq_len) if base is not None else 0
    # with --extend_positions the extension's note gives the run's seq_len (the source's clamp would say it twice)
    fam, cfg = hf_model_config(hf, base, log if extend == 1 else None)
    src_cfg = cfg  # the source's positions: what the tensors are checked and read against
    if extend != 1:
        cfg = extend_positions(cfg, int(extend), want_len or cfg.train.seq_len, log)
    if rope_theta is not None:
        if cfg.model.positions != "rotary":
            raise ConvertError(f"--rope_theta: a {hf['model_type']} model has {cfg.model.positions} positions, no "
                               "rotary base")
        if not (np.isfinite(rope_theta) and rope_theta > 0):
            raise ConvertError(f"--rope_theta={rope_theta} must be a finite number > 0")
        log(f"note: rotary base {cfg.model.rope_theta:g} -> {rope_theta:g} (--rope_theta): the logits differ from "
            "the source's until the model is trained with it")
        cfg.model.rope_theta = float(rope_theta)
    return hf, fam, cfg, src_cfg


def plan_hf(hf_dir, *, config=None, rope_theta: float | None = None, extend: int = 1, devices=None,
            log=print) -> dict:
    """The memory plan of training the import of ``hf_dir`` with ``config`` (``longctx-convert import --plan``):
    from config.json alone (no tensor is read, so a folder with only its config.json plans), the run's config
    is built as :func:`import_hf` builds it and its train step compiled for the config's mesh by
    :func:`longctx.train.dry_run.plan` (abstract parameters: nothing is allocated). Returns the plan."""

    hf, _, cfg, _ = run_config(Path(hf_dir), config, rope_theta=rope_theta, extend=extend, log=log)
    tokenizer = Path(hf_dir) / "tokenizer.json"
    if tokenizer.is_file():  # as import_hf: the run reads the import's tokenizer (its vocabulary, its mask token)
        cfg.data.tokenizer = "hf"
        cfg.data.options.tokenizer_file = str(tokenizer.resolve())
    res = dry_run.plan(cfg, devices)
    log(f"plan of training {hf_dir} ({hf['model_type']}) at train.seq_len={cfg.train.seq_len}, "
        f"train.batch_size={cfg.train.batch_size}, model.remat={cfg.model.remat}, "
        f"model.scan_layers={res['scan_layers']!r}")
    log(dry_run.report(res))
    return res


def import_hf(hf_dir, workdir, *, config=None, dry_run: bool = False, optimizer_state: bool = True,
              rope_theta: float | None = None, extend: int = 1, log=print) -> dict:
    """Convert the Hugging Face folder ``hf_dir`` into the run folder ``workdir`` (see the module's docstring).
    ``config``: a longctx config (a ConfigDict, or a config file ``FILE[:VARIANT]``; default: the base config)
    whose sections other than the architecture the run takes (data, train, eval, execution; the model's
    ``dtype``, ``param_dtype``, ``scan_layers``, ``remat``, ``loss_chunk`` and ``attention``: exact attention by
    default, a ``pattern`` to run another method in chosen layers, :func:`hf_model_config`). ``dry_run``: check the folder (its
    config, every tensor's name and shape) and write nothing. ``optimizer_state=False`` writes no optimizer state
    (enough for longctx-eval and longctx-sample; longctx-train then cannot resume the run). ``rope_theta``: the
    run's rotary base instead of config.json's (context extension by a larger base before continued pretraining;
    the logits then differ from the source's). ``extend``: learned positions ``extend`` times as many, the source's
    rows copied (:func:`extend_positions`; the logits of the first positions stay the source's). Returns a
    summary."""

    hf_dir, workdir = Path(hf_dir), Path(workdir)
    hf, fam, cfg, src_cfg = run_config(hf_dir, config, rope_theta=rope_theta, extend=extend, log=log)
    tokenizer = hf_dir / "tokenizer.json"
    if not tokenizer.is_file():
        log(f"note: no tokenizer.json in {hf_dir}: the run keeps data.tokenizer={cfg.data.tokenizer!r}, whose ids "
            "must be the model's")
    else:
        cfg.data.tokenizer = "hf"
        cfg.data.options.tokenizer_file = str((hf_dir if dry_run else workdir).resolve() / "tokenizer.json")
    folder = Folder(hf_dir)
    check_tensors(fam, src_cfg.model, folder)
    for note in fam.notes(hf):
        log(note)
    n_params = sum(int(np.prod(folder.shape(n))) for n in folder.names())
    summary = {"family": fam.name, "model_type": hf["model_type"], "tensors": len(folder.names()),
               "parameters": n_params, "tokenizer": tokenizer.is_file()}
    if dry_run:
        cfg = config_lib.validate(cfg)
        check_tokenizer(cfg, tokenizer if tokenizer.is_file() else None)
        log(f"{hf_dir}: a {hf['model_type']} model of {n_params:,} parameters, {len(folder.names())} tensors, all "
            f"present with the shapes config.json implies; tokenizer.json: {'yes' if tokenizer.is_file() else 'no'}")
        return summary
    if (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        raise ConvertError(f"--workdir {workdir} already holds checkpoints; import into a new folder")
    given = copy.deepcopy(cfg)  # config.py keeps the keys unresolved (train.window=0 follows a new seq_len)
    cfg = config_lib.validate(cfg)  # before anything is written
    check_tokenizer(cfg, tokenizer if tokenizer.is_file() else None)
    if extend != 1:  # the source's config, fitted as cfg was (validate says so once, for cfg)
        config_lib.fit_to_run_length(src_cfg.train, say=lambda *_: None)
    graphdef, params, nongrad, rest = load_params(fam, config_lib.validate(src_cfg) if extend != 1 else cfg, folder)
    if extend != 1:
        from flax import nnx

        pure = nnx.to_pure_dict(params)
        pure["pos_embed"]["embedding"] = extended_table(pure["pos_embed"]["embedding"], int(extend),
                                                        int(cfg.model.position_offset))
        graphdef, params, _, _ = abstract_model(cfg)
        nnx.replace_by_pure_dict(params, pure)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"cannot create --workdir {workdir} ({e.strerror or e}); choose a writable folder") from None
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, workdir / "tokenizer.json")
    tree = {"params": params, "nongrad": nongrad}
    if optimizer_state:
        tree["opt_state"] = with_loss_scale(make_optimizer(cfg.train), cfg).init(params)
    if scans_layers(cfg.model):
        tree = {k: relayout(v, scanned=True) for k, v in tree.items()}
    save_checkpoint(workdir, tree, cfg)
    (workdir / "config.json").write_text(cfg.to_json(indent=1))
    (workdir / "config.py").write_text(_config_py(given))
    (workdir / "hf_config.json").write_text(json.dumps(hf, indent=1))
    log(f"imported {hf_dir} ({hf['model_type']}, {n_params:,} parameters) into {workdir}: checkpoint at step 0"
        + ("" if optimizer_state else " without optimizer state"))
    return summary


def save_checkpoint(workdir: Path, tree: dict, cfg) -> None:
    mngr = checkpoint.manager(workdir, keep=cfg.train.keep_checkpoints, async_save=False)
    try:
        checkpoint.save(mngr, 0, tree, config=cfg, extra={"data_dir": ""})
        checkpoint.wait(mngr)
    finally:
        mngr.close()


def export_hf(workdir, hf_dir, *, step: int | None = None, log=print) -> dict:
    """Write the run ``workdir``'s model (newest valid checkpoint, or ``step``) as a Hugging Face folder
    ``hf_dir`` (a new or empty folder)."""
    from flax import nnx

    hf_dir = Path(hf_dir)
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise ConvertError(f"--hf_dir {hf_dir} exists and is not an empty folder; export into a new folder")
    runner = Runner.from_workdir(workdir, step=step)
    m = runner.cfg.model
    fam = families.family_of_model(m)
    methods = _layer_methods(m)
    exact = exact_method()
    if any(x != exact for x in methods):
        raise ConvertError(f"the run's layers run {sorted(set(methods))}; transformers computes exact softmax "
                           f"attention, so only a model whose every layer runs {exact!r} exports")
    params = runner.params[0]
    if scans_layers(m):
        params = relayout(params, scanned=False)
    pure = nnx.to_pure_dict(params)
    source = Path(workdir) / "hf_config.json"
    max_positions = int(runner.cfg.train.seq_len)
    if source.is_file():
        try:
            max_positions = max(max_positions, int(json.loads(source.read_text()).get("max_position_embeddings", 0)))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    hf = fam.hf_config(m, max_positions=max_positions)
    items = []
    for e in fam.entries(m):
        x = _get(pure, e.path)
        dtype = np.dtype(x.dtype)
        for j, (name, shape) in enumerate(zip(e.names, e.shapes)):
            # each tensor is produced when written; the parameter stays where it is until then
            items.append((name, shape, dtype, lambda e=e, x=x, j=j: e.split(np.asarray(jax.device_get(x)))[j]))
    hf["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[str(items[0][2])]
    hf_dir.mkdir(parents=True, exist_ok=True)
    write(hf_dir / "model.safetensors", items, metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tok = runner.cfg.data.options.tokenizer_file if runner.cfg.data.tokenizer == "hf" else ""
    if tok and Path(tok).is_file():
        shutil.copyfile(tok, hf_dir / "tokenizer.json")
    log(f"exported {workdir} (step {runner.step}) to {hf_dir} as a {hf['model_type']} model")
    if not (hf_dir / "tokenizer.json").is_file():
        kind = runner.cfg.data.tokenizer
        log(f"note: no tokenizer.json written: the run's data.tokenizer={kind!r} is longctx's own "
            + ("(a token id is a byte value, 0-255)" if kind == "bytes" else
               "(its vocabulary lives in the run's prepared data, not in Hugging Face's format)")
            + "; tokenize with longctx, or train with data.tokenizer='hf' to export one")
    return {"step": runner.step, "model_type": hf["model_type"], "tensors": len(items)}


def _layer_methods(m) -> tuple:
    return layer_methods(m)
