"""Make the Hugging Face fixtures of tests/convert/: tiny random models saved as Hugging Face folders, with the
logits ``transformers`` computes on fixed token ids.

Needs torch and transformers, which longctx does not depend on; run it in a separate environment, e.g.

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers numpy
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--only bert_tiny,roberta_tiny]

Fixtures: llama_tiny (grouped-query attention, SwiGLU, untied), qwen2_tiny (q/k/v biases, tied, another rotary
base), gpt2_tiny (learned positions, LayerNorm, GELU, biases, tied), and the masked-LM encoders bert_tiny
(post-norm, two token types, exact GELU, its own decoder: untied) and roberta_tiny (positions from
pad_token_id + 1, one token type, tied). Each folder holds config.json, model.safetensors (float32),
tokenizer.json (llama_tiny), and reference.npz with ``ids`` [2, 16] int32 (never RoBERTa's padding id, which
transformers gives the padding position) and ``logits`` [2, 16, vocab] float32 (eager attention, float32).
Every parameter, the norms' scales and the biases included, is drawn at random (norm scales around 1), so a
misplaced tensor changes the logits. The tests need no torch: they read these files only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

FIXTURES = {
    # Llama: grouped-query attention (4 heads, 2 k/v heads), SwiGLU, untied output embeddings, no biases
    "llama_tiny": ("llama", dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                 rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64)),
    # Qwen2: biases on q, k and v, tied embeddings, another rotary base and epsilon
    "qwen2_tiny": ("qwen2", dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, rope_theta=1000000.0,
                                 rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=64)),
    # GPT-2: learned positions, LayerNorm, GELU (tanh form), biases everywhere, tied embeddings
    "gpt2_tiny": ("gpt2", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64,
                               activation_function="gelu_new", layer_norm_epsilon=1e-5)),
    # BERT (BertForMaskedLM): post-norm blocks, learned positions, two token types, exact GELU, an untied decoder
    "bert_tiny": ("bert", dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, max_position_embeddings=40, type_vocab_size=2,
                               hidden_act="gelu", layer_norm_eps=1e-12, tie_word_embeddings=False)),
    # RoBERTa (RobertaForMaskedLM): positions from row pad_token_id + 1 = 2, one token type, tied decoder
    "roberta_tiny": ("roberta", dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=34, type_vocab_size=1,
                                     hidden_act="gelu", layer_norm_eps=1e-5, pad_token_id=1)),
}


def tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer.json of ``vocab_size`` tokens (<unk>, </s>, then 'w2', 'w3', ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def make(name: str, model_type: str, kw: dict, out: Path) -> None:
    import transformers

    cls_cfg, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                          "bert": ("BertConfig", "BertForMaskedLM"),
                          "roberta": ("RobertaConfig", "RobertaForMaskedLM")}[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_cfg)(**kw, attn_implementation="eager")
    model = getattr(transformers, cls_model)(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            is_norm_scale = pname.lower().endswith("norm.weight") or ".ln_" in pname and pname.endswith(".weight")
            p.copy_(1.0 + 0.1 * noise if is_norm_scale or pname.endswith("ln_f.weight") else 0.2 * noise)
        head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
        head = getattr(head, "predictions", head)
        if model_type in ("bert", "roberta") and head.decoder.bias is not head.bias:
            head.decoder.bias.copy_(head.bias)  # one tensor in every checkpoint; an untied head holds two copies
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    if model_type == "llama":
        (folder / "tokenizer.json").write_text(tokenizer_json(kw["vocab_size"]))
    ids = np.random.default_rng(0).integers(0, kw["vocab_size"], size=(2, 16)).astype(np.int32)
    if model_type == "roberta":  # no padding token: transformers would give it the padding position
        ids[ids == kw["pad_token_id"]] = kw["pad_token_id"] + 1
    with torch.no_grad():
        logits = model(torch.from_numpy(ids).long()).logits.float().numpy()
    np.savez(folder / "reference.npz", ids=ids, logits=logits.astype(np.float32))
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{folder}: {size / 1024:.1f} KiB; transformers {transformers.__version__}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"))
    ap.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in FIXTURES]
    if unknown:
        ap.error(f"unknown fixture {unknown[0]!r}; known: {', '.join(FIXTURES)}")
    for name, (model_type, kw) in FIXTURES.items():
        if not only or name in only:
            make(name, model_type, kw, Path(args.out))


if __name__ == "__main__":
    main()
