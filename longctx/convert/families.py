"""What a converter knows of a model family: the longctx ``model`` keys its ``config.json`` stands for, the
Hugging Face tensors each longctx parameter is made of, and the ``config.json`` of a longctx model (export).

An :class:`Entry` ties one longctx parameter (its path in ``nnx.to_pure_dict(params)``) to the Hugging Face
tensors it is made of, with their shapes as the ``config.json`` implies them, and one of three ways of joining
them, each with its exact inverse for export:

* ``'copy'``: the tensor itself (embeddings, norm scales);
* ``'linear'``: PyTorch ``Linear`` weights [out, in], transposed to flax's [in, out] kernel and, when there are
  several (q, k and v), concatenated along the output axis in the order given;
* ``'concat'``: biases, concatenated in the order given;
* ``'same'``: one tensor stored under several names (an untied BERT head's ``bias`` and ``decoder.bias``), which
  must be equal; export writes it under each.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from longctx import config as config_lib
from longctx.convert.errors import ConvertError


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    kind: str  # 'copy' | 'linear' | 'concat' | 'same'

    def join(self, arrays: list[np.ndarray], dtype) -> np.ndarray:
        if self.kind == "same":
            if not all(np.array_equal(arrays[0], a) for a in arrays[1:]):
                raise ConvertError(f"tensors {' and '.join(self.names)} differ; the model has one tensor for them")
            return np.asarray(arrays[0], dtype=dtype)
        if self.kind == "copy":
            return np.asarray(arrays[0], dtype=dtype)
        if self.kind == "linear":
            parts = [a.T.astype(dtype) for a in arrays]
            return np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts, axis=1)
        return np.concatenate([a.astype(dtype) for a in arrays], axis=0)

    def split(self, x: np.ndarray) -> list[np.ndarray]:
        """The Hugging Face tensors of the longctx parameter ``x`` (the inverse of :meth:`join`)."""
        x = np.asarray(x)
        if self.kind == "copy":
            return [x]
        if self.kind == "same":
            return [x] * len(self.names)
        sizes = np.cumsum([s[0] for s in self.shapes])[:-1]
        if self.kind == "linear":
            return [np.ascontiguousarray(p.T) for p in np.split(x, sizes, axis=1)]
        return [np.ascontiguousarray(p) for p in np.split(x, sizes, axis=0)]

# the architecture keys some family sets and others leave at their defaults (an import resets them first)
ARCHITECTURE_KEYS = ("post_norm", "type_vocab_size", "position_offset", "head_transform", "head_bias")


def encoder_options(m) -> str | None:
    """The first of :data:`ARCHITECTURE_KEYS` the model ``m`` sets away from its default (a decoder family has
    none of them), as ``model.KEY=VALUE``; None: all at their defaults."""

    defaults = config_lib.base_config().model
    for k in ARCHITECTURE_KEYS:
        if m.get(k, defaults[k]) != defaults[k]:
            return f"model.{k}={m.get(k)!r}"
    return None


def need(hf: dict, *keys: str) -> None:
    for k in keys:
        v = hf.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConvertError(f"config.json: {k} is {v!r}; a {hf.get('model_type')} config needs a positive integer")


class Llama:
    """Llama-style decoders: ``model_type`` llama, mistral or qwen2 (``LlamaForCausalLM`` and its kin):
    RMSNorm pre-norm blocks, rotary positions (rotate-half), grouped-query attention, a gated MLP (SwiGLU, or GeGLU
    for ``hidden_act='gelu_pytorch_tanh'``), optional attention and MLP biases (qwen2: biases on q, k and v), tied
    or untied output embeddings."""

    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
    # tensors a checkpoint may hold that carry nothing the model needs (older Llama saves kept the rotary table)
    ignored_suffixes = (".rotary_emb.inv_freq",)

    @classmethod
    def model_keys(cls, hf: dict) -> dict:
        """The longctx ``model`` keys of a ``config.json``."""
        mt = hf["model_type"]
        need(hf, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        d, H = hf["hidden_size"], hf["num_attention_heads"]
        Dh = hf.get("head_dim") or (d // H if d % H == 0 else None)
        if not Dh:
            raise ConvertError(f"config.json: hidden_size={d} is not a multiple of num_attention_heads={H} and no "
                               "head_dim is given")
        Hkv = hf.get("num_key_value_heads") or H
        if not isinstance(Hkv, int) or H % Hkv:
            raise ConvertError(f"config.json: num_key_value_heads={Hkv!r} must divide num_attention_heads={H}")
        act = hf.get("hidden_act", "silu")
        if act not in cls.ACTS:
            raise ConvertError(f"config.json: hidden_act={act!r} is not supported; allowed: {', '.join(cls.ACTS)}")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if rope_type not in (None, "default"):
            raise ConvertError(f"config.json: rope scaling {rope_type!r} is not supported yet (only plain rotary "
                               "positions, rope_type 'default')")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
        if mt == "qwen2":
            qkv_bias, out_bias, mlp_bias = True, False, False
        else:
            qkv_bias = out_bias = bool(hf.get("attention_bias", False))
            mlp_bias = bool(hf.get("mlp_bias", False))
        return {
            "kind": "decoder", "causal": True, "block": "transformer", "dropout": 0.0,
            "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["num_hidden_layers"], "num_heads": H,
            "head_dim": int(Dh), "d_ff": hf["intermediate_size"], "num_kv_heads": 0 if Hkv == H else Hkv,
            "mlp": cls.ACTS[act], "mlp_bias": mlp_bias, "qkv_bias": qkv_bias, "out_bias": out_bias,
            "norm": "rmsnorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "positions": "rotary",
            "rope_theta": float(theta), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    @classmethod
    def notes(cls, hf: dict) -> list[str]:
        """What the import cannot reproduce exactly, said once."""
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", hf["model_type"] == "mistral"):
            return [f"note: config.json has sliding_window={window}; longctx's exact attention sees the whole "
                    f"context, so logits equal transformers' for sequences of up to {window} tokens"]
        return []

    @classmethod
    def rename(cls, names, m=None) -> dict:
        """Folder name -> the name :meth:`entries` uses (here: the same)."""
        return {n: n for n in names}

    @classmethod
    def entries(cls, m) -> list[Entry]:
        """Every parameter of the longctx model of ``m`` (the ``model`` section) and its Hugging Face tensors."""
        d, H, Dh, I, V = m.d_model, m.num_heads, m.head_dim, m.d_ff, m.vocab_size
        Hkv = int(m.num_kv_heads or H)
        E = [Entry(("embed", "embedding"), ("model.embed_tokens.weight",), ((V, d),), "copy")]
        for i in range(m.num_layers):
            p, b = f"model.layers.{i}.", ("blocks", i)
            att = [f"{p}self_attn.{x}_proj" for x in "qkv"]
            E.append(Entry((*b, "norm1", "scale"), (f"{p}input_layernorm.weight",), ((d,),), "copy"))
            E.append(Entry((*b, "qkv", "kernel"), tuple(f"{a}.weight" for a in att),
                           ((H * Dh, d), (Hkv * Dh, d), (Hkv * Dh, d)), "linear"))
            if m.qkv_bias:
                E.append(Entry((*b, "qkv", "bias"), tuple(f"{a}.bias" for a in att),
                               ((H * Dh,), (Hkv * Dh,), (Hkv * Dh,)), "concat"))
            E.append(Entry((*b, "out", "kernel"), (f"{p}self_attn.o_proj.weight",), ((d, H * Dh),), "linear"))
            if m.out_bias:
                E.append(Entry((*b, "out", "bias"), (f"{p}self_attn.o_proj.bias",), ((d,),), "concat"))
            E.append(Entry((*b, "norm2", "scale"), (f"{p}post_attention_layernorm.weight",), ((d,),), "copy"))
            for ours, theirs, shape in (("gate", "gate_proj", (I, d)), ("up", "up_proj", (I, d)),
                                        ("down", "down_proj", (d, I))):
                E.append(Entry((*b, "mlp", ours, "kernel"), (f"{p}mlp.{theirs}.weight",), (shape,), "linear"))
                if m.mlp_bias:
                    E.append(Entry((*b, "mlp", ours, "bias"), (f"{p}mlp.{theirs}.bias",), ((shape[0],),), "concat"))
        E.append(Entry(("norm", "scale"), ("model.norm.weight",), ((d,),), "copy"))
        if not m.tie_embeddings:
            E.append(Entry(("head", "kernel"), ("lm_head.weight",), ((V, d),), "linear"))
        return E

    @classmethod
    def exportable(cls, m) -> str | None:
        """Why the longctx model ``m`` has no Llama-family ``config.json`` (None: it has one)."""
        want = {"kind": "decoder", "block": "transformer", "norm": "rmsnorm", "positions": "rotary", "causal": True}
        for k, v in want.items():
            if m[k] != v:
                return f"model.{k}={m[k]!r} (the Llama family has {k}={v!r})"
        if encoder_options(m):
            return f"{encoder_options(m)} (the Llama family has none of BERT's options)"
        if m.mlp not in ("swiglu", "geglu"):
            return f"model.mlp={m.mlp!r} (the Llama family has a gated MLP: 'swiglu' or 'geglu')"
        if m.qkv_bias != m.out_bias and not (m.qkv_bias and not m.mlp_bias and m.mlp == "swiglu"):
            return (f"model.qkv_bias={m.qkv_bias} with model.out_bias={m.out_bias} (Llama's attention_bias sets both; "
                    "qwen2 has q/k/v biases only, with a SwiGLU MLP without biases)")
        return None

    @classmethod
    def hf_config(cls, m, *, max_positions: int) -> dict:
        """The ``config.json`` of the longctx model ``m``: ``qwen2`` for q/k/v biases without an output bias,
        else ``llama``."""
        H = m.num_heads
        qwen = m.qkv_bias and not m.out_bias
        cfg = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
            "num_hidden_layers": m.num_layers, "num_attention_heads": H,
            "num_key_value_heads": int(m.num_kv_heads or H),
            "head_dim": m.head_dim, "hidden_act": "silu" if m.mlp == "swiglu" else "gelu_pytorch_tanh",
            "max_position_embeddings": int(max_positions), "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": bool(m.tie_embeddings), "initializer_range": 0.02,
            "use_cache": True, "torch_dtype": "float32",
        }
        if not qwen:
            cfg.update(attention_bias=bool(m.qkv_bias), mlp_bias=bool(m.mlp_bias), attention_dropout=0.0)
        else:
            cfg.update(use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
        return cfg


class GPT2:
    """GPT-2 (``model_type`` gpt2, ``GPT2LMHeadModel``): learned positions, LayerNorm pre-norm blocks, a GELU MLP
    (tanh form, ``gelu_new``), biases on every projection, tied output embeddings. Its ``Conv1D`` weights are
    already [in, out], flax's layout, so they are copied as they are; ``c_attn`` is q, k and v side by side, as
    longctx's ``qkv``. Tensor names with or without the ``transformer.`` prefix (the original checkpoints have
    none) are both read."""

    name = "gpt2"
    model_types = ("gpt2",)
    ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
    # the causal-mask buffers older saves kept
    ignored_suffixes = (".attn.bias", ".attn.masked_bias")

    @classmethod
    def model_keys(cls, hf: dict) -> dict:
        need(hf, "n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
        d, H = hf["n_embd"], hf["n_head"]
        if d % H:
            raise ConvertError(f"config.json: n_embd={d} is not a multiple of n_head={H}")
        act = hf.get("activation_function", "gelu_new")
        if act not in cls.ACTS:
            raise ConvertError(f"config.json: activation_function={act!r} is not supported; allowed: "
                               f"{', '.join(cls.ACTS)} (longctx's GELU is the tanh form)")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ConvertError("config.json: scale_attn_by_inverse_layer_idx=true or scale_attn_weights=false is "
                               "not supported (longctx scales attention scores by 1/sqrt(head_dim))")
        if not hf.get("tie_word_embeddings", True):
            raise ConvertError("config.json: tie_word_embeddings=false is not supported for gpt2")
        return {
            "kind": "decoder", "causal": True, "block": "transformer", "dropout": 0.0,
            "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["n_layer"], "num_heads": H,
            "head_dim": d // H, "d_ff": hf.get("n_inner") or 4 * d, "num_kv_heads": 0, "mlp": "gelu",
            "mlp_bias": True, "qkv_bias": True, "out_bias": True, "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "positions": "learned", "max_len": hf["n_positions"],
            "rope_theta": 10000.0, "tie_embeddings": True,
        }

    @classmethod
    def notes(cls, hf: dict) -> list[str]:
        return []

    @classmethod
    def rename(cls, names, m=None) -> dict:
        """Folder name -> the name :meth:`entries` uses (the ``transformer.`` prefix added where it is missing)."""
        return {n: n if n.startswith("transformer.") or n == "lm_head.weight" else f"transformer.{n}" for n in names}

    @classmethod
    def entries(cls, m) -> list[Entry]:
        d, I, V, P = m.d_model, m.d_ff, m.vocab_size, m.max_len
        E = [Entry(("embed", "embedding"), ("transformer.wte.weight",), ((V, d),), "copy"),
             Entry(("pos_embed", "embedding"), ("transformer.wpe.weight",), ((P, d),), "copy")]
        for i in range(m.num_layers):
            p, b = f"transformer.h.{i}.", ("blocks", i)
            for ours, theirs, shape in (("norm1", "ln_1", None), ("qkv", "attn.c_attn", (d, 3 * d)),
                                        ("out", "attn.c_proj", (d, d)), ("norm2", "ln_2", None),
                                        (("mlp", "up"), "mlp.c_fc", (d, I)), (("mlp", "down"), "mlp.c_proj", (I, d))):
                ours = ours if isinstance(ours, tuple) else (ours,)
                if shape is None:  # a LayerNorm
                    E.append(Entry((*b, *ours, "scale"), (f"{p}{theirs}.weight",), ((d,),), "copy"))
                    E.append(Entry((*b, *ours, "bias"), (f"{p}{theirs}.bias",), ((d,),), "copy"))
                else:
                    E.append(Entry((*b, *ours, "kernel"), (f"{p}{theirs}.weight",), (shape,), "copy"))
                    E.append(Entry((*b, *ours, "bias"), (f"{p}{theirs}.bias",), ((shape[1],),), "copy"))
        E.append(Entry(("norm", "scale"), ("transformer.ln_f.weight",), ((d,),), "copy"))
        E.append(Entry(("norm", "bias"), ("transformer.ln_f.bias",), ((d,),), "copy"))
        return E

    @classmethod
    def exportable(cls, m) -> str | None:
        want = {"kind": "decoder", "block": "transformer", "norm": "layernorm", "positions": "learned",
                "causal": True, "mlp": "gelu", "mlp_bias": True, "qkv_bias": True, "out_bias": True,
                "tie_embeddings": True}
        for k, v in want.items():
            if m[k] != v:
                return f"model.{k}={m[k]!r} (GPT-2 has {k}={v!r})"
        if encoder_options(m):
            return f"{encoder_options(m)} (GPT-2 has none of BERT's options)"
        if m.num_kv_heads not in (0, m.num_heads) or m.num_heads * m.head_dim != m.d_model:
            return "GPT-2 has num_heads * head_dim = d_model and no grouped-query attention"
        return None

    @classmethod
    def hf_config(cls, m, *, max_positions: int) -> dict:
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.d_model, "n_layer": m.num_layers, "n_head": m.num_heads, "n_positions": m.max_len,
            "n_inner": m.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps,
            "tie_word_embeddings": True, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        }


class Bert:
    """BERT and RoBERTa encoders with their masked-LM head (``model_type`` bert or roberta; ``BertForMaskedLM``,
    ``RobertaForMaskedLM``) onto longctx's encoder (``model.kind='encoder'``): post-norm LayerNorm blocks
    (``model.post_norm``) with a norm after the embeddings, learned positions (RoBERTa's start at row
    ``pad_token_id + 1``: ``model.position_offset``), token-type embeddings (``model.type_vocab_size``; every token
    is type 0), biases on every projection, a GELU MLP (``hidden_act='gelu'`` is the exact GELU,
    ``model.mlp='gelu_exact'``), and the head's transform (dense, GELU, LayerNorm: ``model.head_transform``) before
    the output embeddings (tied, or the head's own decoder) plus a bias (``model.head_bias``).

    Tensor names are read with or without the ``bert.`` / ``roberta.`` prefix (a checkpoint saved from the bare
    encoder has none, and then no head: its head tensors are named missing), and with the LayerNorm ``gamma`` /
    ``beta`` of the original TensorFlow conversions. The pooler and the next-sentence head of a pre-training
    checkpoint, the tied decoder and its bias (the head's ``bias`` itself) and the ``position_ids`` buffer carry
    nothing the masked-LM model needs."""

    name = "bert"
    model_types = ("bert", "roberta")
    ACTS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
    ignored_suffixes = ("pooler.dense.weight", "pooler.dense.bias", "seq_relationship.weight",
                        "seq_relationship.bias", "embeddings.position_ids", "predictions.decoder.bias",
                        "lm_head.decoder.bias", "predictions.decoder.weight", "lm_head.decoder.weight")
    PREFIX = {"bert": "bert.", "roberta": "roberta."}

    @classmethod
    def model_keys(cls, hf: dict) -> dict:
        mt = hf["model_type"]
        need(hf, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "max_position_embeddings")
        d, H = hf["hidden_size"], hf["num_attention_heads"]
        if d % H:
            raise ConvertError(f"config.json: hidden_size={d} is not a multiple of num_attention_heads={H}")
        act = hf.get("hidden_act", "gelu")
        if act not in cls.ACTS:
            raise ConvertError(f"config.json: hidden_act={act!r} is not supported; allowed: {', '.join(cls.ACTS)}")
        pos = hf.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ConvertError(f"config.json: position_embedding_type={pos!r} is not supported (only 'absolute', "
                               "learned positions)")
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise ConvertError(f"config.json: is_decoder or add_cross_attention is set; longctx converts the {mt} "
                               "masked-LM encoder only")
        offset = 0
        if mt == "roberta":
            pad = hf.get("pad_token_id", 1)
            if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
                raise ConvertError(f"config.json: pad_token_id={pad!r}; a roberta config needs an integer >= 0 (its "
                                   "positions start at pad_token_id + 1)")
            offset = pad + 1
        P = hf["max_position_embeddings"]
        if P <= offset:
            raise ConvertError(f"config.json: max_position_embeddings={P} leaves no position after the offset "
                               f"pad_token_id + 1 = {offset}")
        types = hf.get("type_vocab_size", 2)
        if not isinstance(types, int) or isinstance(types, bool) or types < 1:
            raise ConvertError(f"config.json: type_vocab_size={types!r}; a {mt} config needs a positive integer")
        return {
            "kind": "encoder", "causal": False, "block": "transformer", "dropout": 0.0,
            "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["num_hidden_layers"], "num_heads": H,
            "head_dim": d // H, "d_ff": hf["intermediate_size"], "num_kv_heads": 0, "mlp": cls.ACTS[act],
            "mlp_bias": True, "qkv_bias": True, "out_bias": True, "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_eps", 1e-12)), "positions": "learned", "max_len": P - offset,
            "position_offset": offset, "type_vocab_size": types, "post_norm": True, "head_transform": True,
            "head_bias": True, "rope_theta": 10000.0, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        }

    @classmethod
    def notes(cls, hf: dict) -> list[str]:
        if hf["model_type"] == "roberta":
            return [f"note: roberta positions start at pad_token_id + 1 = {hf.get('pad_token_id', 1) + 1}; longctx "
                    "gives every token of a row its position, so rows hold no padding tokens (transformers gives "
                    "padding tokens the padding position)"]
        return []

    @classmethod
    def rename(cls, names, m=None) -> dict:
        """Folder name -> the name :meth:`entries` uses: the encoder's prefix (``bert.`` / ``roberta.``, as the
        model ``m`` is) added where it is missing, LayerNorm ``gamma`` / ``beta`` as ``weight`` / ``bias``."""
        prefix = cls.PREFIX[cls.model_type_of(m)]
        old = {".gamma": ".weight", ".beta": ".bias"}
        out = {}
        for n in names:
            new = f"{prefix}{n}" if n.startswith(("embeddings.", "encoder.", "pooler.")) else n
            for a, b in old.items():
                if new.endswith(a) and ("LayerNorm" in new or "layer_norm" in new):
                    new = new.removesuffix(a) + b
            out[n] = new
        return out

    @classmethod
    def entries(cls, m) -> list[Entry]:
        d, I, V = m.d_model, m.d_ff, m.vocab_size
        P, types = m.max_len + m.position_offset, m.type_vocab_size
        roberta = cls.model_type_of(m) == "roberta"
        p = cls.PREFIX[cls.model_type_of(m)]
        E = [Entry(("embed", "embedding"), (f"{p}embeddings.word_embeddings.weight",), ((V, d),), "copy"),
             Entry(("pos_embed", "embedding"), (f"{p}embeddings.position_embeddings.weight",), ((P, d),), "copy"),
             Entry(("type_embed", "embedding"), (f"{p}embeddings.token_type_embeddings.weight",), ((types, d),),
                   "copy")]
        E += cls._norm(("embed_norm",), f"{p}embeddings.LayerNorm", d)
        for i in range(m.num_layers):
            q, b = f"{p}encoder.layer.{i}.", ("blocks", i)
            att = [f"{q}attention.self.{x}" for x in ("query", "key", "value")]
            E.append(Entry((*b, "qkv", "kernel"), tuple(f"{a}.weight" for a in att), ((d, d),) * 3, "linear"))
            E.append(Entry((*b, "qkv", "bias"), tuple(f"{a}.bias" for a in att), ((d,),) * 3, "concat"))
            E += cls._dense((*b, "out"), f"{q}attention.output.dense", d, d)
            E += cls._norm((*b, "norm1"), f"{q}attention.output.LayerNorm", d)
            E += cls._dense((*b, "mlp", "up"), f"{q}intermediate.dense", I, d)
            E += cls._dense((*b, "mlp", "down"), f"{q}output.dense", d, I)
            E += cls._norm((*b, "norm2"), f"{q}output.LayerNorm", d)
        h = "lm_head." if roberta else "cls.predictions."
        E += cls._dense(("head_transform", "proj"), "lm_head.dense" if roberta else f"{h}transform.dense", d, d)
        E += cls._norm(("head_transform", "norm"), f"{h}layer_norm" if roberta else f"{h}transform.LayerNorm", d)
        if m.tie_embeddings:  # transformers ties the decoder's bias to the head's bias
            E.append(Entry(("head_bias",), (f"{h}bias",), ((V,),), "copy"))
        else:  # the decoder is a Linear of its own, whose bias transformers uses: the head's bias in a checkpoint
            E.append(Entry(("head_bias",), (f"{h}bias", f"{h}decoder.bias"), ((V,), (V,)), "same"))
            E.append(Entry(("head", "kernel"), (f"{h}decoder.weight",), ((V, d),), "linear"))
        return E

    @staticmethod
    def _dense(path: tuple, name: str, out: int, inp: int) -> list[Entry]:
        return [Entry((*path, "kernel"), (f"{name}.weight",), ((out, inp),), "linear"),
                Entry((*path, "bias"), (f"{name}.bias",), ((out,),), "concat")]

    @staticmethod
    def _norm(path: tuple, name: str, d: int) -> list[Entry]:
        return [Entry((*path, "scale"), (f"{name}.weight",), ((d,),), "copy"),
                Entry((*path, "bias"), (f"{name}.bias",), ((d,),), "copy")]

    @classmethod
    def exportable(cls, m) -> str | None:
        want = {"kind": "encoder", "block": "transformer", "norm": "layernorm", "positions": "learned",
                "post_norm": True, "head_transform": True, "head_bias": True, "mlp_bias": True, "qkv_bias": True,
                "out_bias": True}
        for k, v in want.items():
            if m.get(k) != v:
                return f"model.{k}={m.get(k)!r} (BERT has {k}={v!r})"
        if m.mlp not in ("gelu", "gelu_exact"):
            return f"model.mlp={m.mlp!r} (BERT has a GELU MLP: 'gelu_exact' or 'gelu')"
        if m.type_vocab_size < 1:
            return "model.type_vocab_size=0 (BERT has token-type embeddings)"
        if m.num_kv_heads not in (0, m.num_heads) or m.num_heads * m.head_dim != m.d_model:
            return "BERT has num_heads * head_dim = d_model and no grouped-query attention"
        return None

    @classmethod
    def model_type_of(cls, m) -> str:
        """``roberta`` for a model whose positions start past row 0 (``model.position_offset``), else ``bert``."""
        return "roberta" if m.position_offset > 0 else "bert"

    @classmethod
    def hf_config(cls, m, *, max_positions: int) -> dict:
        roberta = cls.model_type_of(m) == "roberta"
        cfg = {
            "architectures": ["RobertaForMaskedLM" if roberta else "BertForMaskedLM"],
            "model_type": "roberta" if roberta else "bert", "vocab_size": m.vocab_size, "hidden_size": m.d_model,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "intermediate_size": m.d_ff,
            "hidden_act": "gelu" if m.mlp == "gelu_exact" else "gelu_new",
            "max_position_embeddings": m.max_len + m.position_offset, "type_vocab_size": m.type_vocab_size,
            "layer_norm_eps": m.norm_eps, "pad_token_id": m.position_offset - 1 if roberta else 0,
            "position_embedding_type": "absolute", "tie_word_embeddings": bool(m.tie_embeddings),
            "hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": 0.0, "initializer_range": 0.02,
            "is_decoder": False, "torch_dtype": "float32",
        }
        if roberta:
            cfg.update(bos_token_id=0, eos_token_id=2)
        return cfg


FAMILIES = (Llama, GPT2, Bert)


def family_of(model_type) -> type:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    allowed = ", ".join(t for fam in FAMILIES for t in fam.model_types)
    raise ConvertError(f"config.json: model_type {model_type!r} is not supported; allowed: {allowed}")


def family_of_model(m) -> type:
    """The family whose ``config.json`` the longctx model ``m`` can be written as."""
    if m.output == "adaptive":
        raise ConvertError("this run's model has an adaptive softmax (model.output='adaptive'), which no Hugging Face "
                           "family longctx-convert exports has")
    reasons = []
    for fam in FAMILIES:
        why = fam.exportable(m)
        if why is None:
            return fam
        reasons.append(f"{fam.name}: {why}")
    raise ConvertError(f"this run's model is in no family longctx-convert exports ({'; '.join(reasons)})")
