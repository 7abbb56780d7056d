"""Every bad input is answered with one line (what is wrong, what is allowed), exit status 2 and
no traceback: config values of every method and block, the flags of every command, prompts the
tokenizer cannot encode, missing / empty / truncated data files, a workdir holding another run.

``docs/errors.md`` is generated from these cases (the messages as the commands print them):

    .venv/bin/python -m tests.test_bad_inputs > docs/errors.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import sys
from pathlib import Path

import ml_collections
import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    cmd: str  # train | prepare | eval | sample | fill | recall | bench
    # {cfg} tiny config file, {run} trained workdir, {tmp} scratch folder, {other} a copy of {run},
    # {enc} a trained encoder, {mqar} a run trained on the mqar recall task, {fma} an fma run (levels for 64
    # tokens), {learned} a run with learned positions (max_len 32)
    args: tuple[str, ...]
    expect: str  # regex the one error line must match


T = ("--config={cfg}", "--workdir={tmp}/w")  # a valid tiny training command, to which a case adds one bad value
CASES = [
    # config flags and values (longctx-train), every block and method
    Case("unknown config key", "train", (*T, "--config.train.stepz=3"), r"unknown config key 'train.stepz'.*steps"),
    Case("value of the wrong type", "train", (*T, "--config.train.steps=abc"), r"train.steps"),
    Case("missing config file", "train", ("--config={tmp}/nope.py", "--workdir={tmp}/w"), r"config file .*not found"),
    Case("no --workdir", "train", ("--config={cfg}",), r"--workdir is required"),
    Case("config file raises at import", "train", ("--config={tmp}/raises.py", "--workdir={tmp}/w"),
         r"cannot load the config file .*raises.py: RuntimeError: broken at import"),
    Case("config get_config raises", "train", ("--config={tmp}/getraises.py", "--workdir={tmp}/w"),
         r"get_config failed: ZeroDivisionError"),
    Case("config without get_config", "train", ("--config={tmp}/noget.py", "--workdir={tmp}/w"),
         r"not a config file: it defines no get_config"),
    Case("unknown config variant", "train", ("--config={cfg}:huge", "--workdir={tmp}/w"), r"variant|variants"),
    Case("config file raises at import (prepare)", "prepare", ("--config={tmp}/raises.py",),
         r"cannot load the config file .*RuntimeError"),
    Case("unknown config section", "train", (*T, "--config.evl.protocol=x"), r"no section 'evl' \(did you mean 'eval'\?\)"),
    Case("eval: misspelled config key", "eval", ("--workdir={run}", "--config.eval.protcol=sliding"),
         r"unknown config key 'eval.protcol' \(did you mean 'protocol'\?\)"),
    Case("sample: misspelled config key", "sample", ("--workdir={run}", "--config.sample.temprature=0.5"),
         r"unknown config key 'sample.temprature' \(did you mean 'temperature'\?\)"),
    Case("unknown flag", "train", (*T, "--stepz=3"), r"unknown flag --stepz.*allowed"),
    Case("stray argument", "train", (*T, "extra"), r"unexpected argument 'extra'"),
    Case("--max_steps=0", "train", (*T, "--max_steps=0"), r"max_steps=0 must be a positive"),
    Case("window does not divide seq_len", "train", (*T, "--config.train.window=24"), r"window=24 must divide"),
    Case("steps not a multiple of windows", "train", (*T, "--config.train.window=16", "--config.train.steps=7"),
         r"multiple of seq_len/window"),
    Case("unknown attention method", "train", (*T, "--config.model.attention.name=flash"), r"allowed: .*dense"),
    Case("an implementation this platform cannot run", "train",
         (*T, "--config.execution.attention.dense.impl=cudnn"),
         r"execution.attention.dense.impl='cudnn' cannot run on cpu \(cudnn runs on cuda\); use 'auto' or one of"),
    Case("unknown block", "train", (*T, "--config.model.block=mamba"), r"allowed: .*transformer"),
    Case("unknown positions", "train", (*T, "--config.model.positions=alibi"), r"choose one of"),
    Case("dropout out of range", "train", (*T, "--config.model.dropout=1.5"), r"\[0, 1\)"),
    Case("gau_layerdrop out of range", "train", (*T, "--config.model.block=gau", "--config.model.gau_layerdrop=1.0"),
         r"gau_layerdrop=1.0 must be in \[0, 1\)"),
    Case("odd head_dim with rotary", "train", (*T, "--config.model.head_dim=15"), r"even model.head_dim"),
    Case("adaptive softmax with tied embeddings", "train", (*T, "--config.model.output=adaptive"),
         r"tie_embeddings=False"),
    Case("dense: unknown option", "train", (*T, "--config.model.attention.dense.flash=true"), r"unknown config key"),
    Case("transformer_vq: bad codebook size", "train",
         (*T, "--config.model.block=gau", "--config.model.positions=none", "--config.model.num_heads=1",
          "--config.model.attention.name=transformer_vq", "--config.model.attention.transformer_vq.codebook_size=0"),
         r"codebook_size"),
    Case("eva: bad option", "train", (*T, "--config.model.attention.name=eva", "--config.model.attention.eva.chunk_size=0"),
         r"chunk_size"),
    Case("negative learning rate", "train", (*T, "--config.train.lr=-1"), r"train.lr=-1.0 must be positive"),
    Case("negative warm-up", "train", (*T, "--config.train.warmup_steps=-1"), r"warmup_steps=-1 must be in"),
    Case("stride longer than context", "train", (*T, "--config.eval.stride=1000"), r"at most eval.context"),
    Case("mesh axis below 1", "train", (*T, "--config.mesh.tensor=0"), r"mesh.tensor=0 must be >= 1"),
    Case("unknown sequence mode", "train", (*T, "--config.mesh.sequence_mode=ring"),
         r"mesh.sequence_mode='ring'; allowed: auto, compose, xla"),
    Case("a causal encoder", "train", (*T, "--config.model.kind=encoder", "--config.model.causal=true"),
         r"model.kind='encoder' trains bidirectional blocks"),
    Case("composed states for an encoder", "train",
         (*T, "--config.model.kind=encoder", "--config.model.causal=false", "--config.mesh.sequence_mode=compose"),
         r"an encoder has none"),
    Case("unknown data source", "train", (*T, "--config.data.source=imagenet"), r"allowed"),
    Case("unknown tokenizer", "train", (*T, "--config.data.tokenizer=chars"), r"allowed"),
    # data files
    Case("enwik8 file missing", "train", (*T, "--config.data.source=enwik8", "--config.data.path={tmp}/missing.zip"),
         r"enwik8: .*does not exist"),
    Case("enwik8 file empty", "train", (*T, "--config.data.source=enwik8", "--config.data.path={tmp}/empty/enwik8.zip"),
         r"enwik8: .*0 bytes, expected"),
    Case("enwik8 zip truncated", "train", (*T, "--config.data.source=enwik8", "--config.data.options.verify=false",
                                           "--config.data.path={tmp}/truncated/enwik8.zip"), r"corrupt or truncated"),
    Case("built-in corpus folder without .py files", "train", (*T, "--config.data.path={tmp}/nofiles"), r"no .py files"),
    Case("pg19 metadata.csv with a bad row", "train",
         (*T, "--config.data.source=pg19", "--config.data.tokenizer=bytes", "--config.data.path={tmp}/pg19"),
         r"metadata.csv line 1 has 2 fields"),
    Case("pg19 metadata.csv not UTF-8", "train",
         (*T, "--config.data.source=pg19", "--config.data.tokenizer=bytes", "--config.data.path={tmp}/pg19latin1"),
         r"pg19: .*metadata.csv is not valid UTF-8 .*copy it again"),
    Case("wikitext103 folder without its files", "train",
         (*T, "--config.data.source=wikitext103", "--config.data.tokenizer=words", "--config.data.path={tmp}/nofiles"),
         r"wikitext103: missing"),
    Case("workdir holds another run", "train", ("--config={cfg}", "--workdir={other}", "--config.model.d_model=64"),
         r"workdir holds a run with a different model config"),
    # longctx-prepare
    Case("prepare: unknown flag", "prepare", ("--config={cfg}", "--split=test"), r"unknown flag --split"),
    Case("prepare: data file missing", "prepare", ("--config={cfg}", "--config.data.source=enwik8",
                                                   "--config.data.path={tmp}/missing.zip"), r"does not exist"),
    # longctx-eval
    Case("eval: workdir missing", "eval", ("--workdir={tmp}/none",), r"does not exist: train first"),
    Case("eval: workdir without checkpoints", "eval", ("--workdir={tmp}/nofiles",), r"no checkpoints .*train first"),
    Case("eval: unknown split", "eval", ("--workdir={run}", "--split=dev"), r"--split=dev: value should be one of <train\|valid\|test>"),
    Case("eval: unknown protocol", "eval", ("--workdir={run}", "--config.eval.protocol=best"), r"choose one of"),
    Case("eval: changing the model", "eval", ("--workdir={run}", "--config.model.d_model=8"), r"allowed here"),
    Case("eval: a method other than dense or swa", "eval", ("--workdir={run}", "--config.model.attention.name=eva"),
         r"changes only between dense and swa"),
    Case("eval: an fma run over a sliding window", "eval", ("--workdir={fma}", "--config.model.attention.name=swa"),
         r"only a dense or swa run is scored with the other"),
    Case("eval: a config file", "eval", ("--workdir={run}", "--config=configs/default.py"),
         r"reads the config saved in --workdir"),
    Case("eval: checkpoint step not there", "eval", ("--workdir={run}", "--step=999"), r"step 999 not found"),
    Case("eval: unknown flag", "eval", ("--workdir={run}", "--set=eval.protocol=sliding"), r"unknown flag --set"),
    # longctx-sample
    Case("sample: negative temperature", "sample", ("--workdir={run}", "--temperature=-1"),
         r"temperature=-1.0 must be a finite number >= 0"),
    Case("sample: zero tokens", "sample", ("--workdir={run}", "--num_tokens=0"), r"num_tokens=0 must be a positive"),
    Case("sample: top_p above 1", "sample", ("--workdir={run}", "--top_p=1.5"), r"top_p=1.5 must be in \(0, 1\]"),
    Case("sample: temperature not a number", "sample", ("--workdir={run}", "--temperature=hot"), r"temperature"),
    Case("sample: empty prompt", "sample", ("--workdir={run}", "--prompt="), r"prompt is empty"),
    Case("sample: prompt the tokenizer cannot encode", "sample", ("--workdir={run}", "--prompt=\udcff"),
         r"cannot be encoded by the 'bytes' tokenizer"),
    Case("sample: prompt file missing", "sample", ("--workdir={run}", "--prompt_file={tmp}/none.txt"),
         r"cannot read --prompt_file"),
    Case("sample: prompt file not UTF-8", "sample", ("--workdir={run}", "--prompt_file={tmp}/latin1.txt"),
         r"is not UTF-8"),
    Case("sample: --prompt and --prompt_file", "sample", ("--workdir={run}", "--prompt=a", "--prompt_file={tmp}/a.txt"),
         r"not both"),
    Case("sample: output exists", "sample", ("--workdir={run}", "--output={tmp}/a.txt"), r"never overwritten"),
    Case("sample: flags disagree", "sample", ("--workdir={run}", "--seed=1", "--config.sample.seed=2"), r"disagree"),
    *(Case(f"sample: {what}", "sample", ("--workdir={run}", *args), expect) for what, args, expect in (
        ("temperature not finite", ("--temperature=nan",), r"temperature=nan must be a finite number"),
        ("infinite temperature", ("--temperature=inf",), r"temperature=inf must be a finite number"),
        ("negative top_k", ("--top_k=-1",), r"top_k=-1 must be an integer >= 0"),
        ("top_k beyond the vocabulary", ("--top_k=100000",), r"top_k=100000 exceeds the vocabulary \(256 tokens\)"),
        ("num_tokens too large", ("--num_tokens=100000000",), r"num_tokens=100000000 must be a positive integer \(at most"),
        ("negative num_tokens", ("--num_tokens=-5",), r"num_tokens=-5 must be a positive"),
        ("top_p zero", ("--top_p=0",), r"top_p=0.0 must be in \(0, 1\]"),
        ("top_p not finite", ("--top_p=nan",), r"top_p=nan must be in"),
        ("negative seed", ("--seed=-1",), r"sample.seed=-1 must be an integer >= 0"),
        ("output under a file", ("--output={tmp}/a.txt/x.txt",), r"a.txt is not a folder"),
        ("prompt file endless", ("--prompt_file=/dev/zero",), r"longer than .* bytes"),
        ("prompt file a folder", ("--prompt_file={tmp}",), r"cannot read --prompt_file"),
        ("eval override out of range", ("--config.eval.stride=-4",), r"eval.stride=-4 must be"),
        ("step not there", ("--step=999",), r"step 999 not found"),
        ("changing the model", ("--config.model.num_layers=1",), r"allowed here"),
    )),
    Case("sample: an encoder run", "sample", ("--workdir={enc}",), r"encoder .*longctx-fill"),
    Case("sample: the samples folder a file", "sample", ("--workdir={other}",), r"samples is a file, not the folder of samples"),
    Case("eval: a stream longer than the state holds", "eval", ("--workdir={fma}", "--config.eval.row_len=-1"),
         r"max_len=64.*the evaluation carries the state through [0-9,]+ tokens.*eval.row_len=N"),
    Case("sample: prompt longer than the state", "sample", ("--workdir={fma}", "--num_tokens=200"),
         r"cannot sample \d+ prompt \+ 200 new tokens: .*max_len=64"),
    # longctx-eval: ranges of the eval settings (a negative stride used to hang), other runs, files
    *(Case(f"eval: {what}", "eval", ("--workdir={run}", *args), expect) for what, args, expect in (
        ("negative stride", ("--config.eval.protocol=sliding", "--config.eval.stride=-4"),
         r"eval.stride=-4 must be an integer >= 1, or 0"),
        ("negative context", ("--config.eval.protocol=sliding", "--config.eval.context=-1"),
         r"eval.context=-1 must be an integer >= 1, or 0"),
        ("negative window", ("--config.eval.window=-3",), r"eval.window=-3 must be"),
        ("negative row_len", ("--config.eval.row_len=-7",), r"eval.row_len=-7 must be an integer >= 1, or 0 .* or -1"),
        ("zero batch size", ("--config.eval.batch_size=0",), r"eval.batch_size=0 must be a positive integer"),
        ("negative max_tokens", ("--config.eval.max_tokens=-1",), r"eval.max_tokens=-1 must be"),
        ("negative max_bytes", ("--config.eval.max_bytes=-1",), r"eval.max_bytes=-1 must be an integer >= 0"),
        ("two budgets", ("--config.eval.max_tokens=64", "--config.eval.max_bytes=64"),
         r"eval.max_tokens=64 and eval.max_bytes=64: give one budget and set the other to 0"),
        ("unknown reset", ("--config.eval.reset=sometimes",), r"choose one of: document, row, never"),
        ("data.cache_dir a file", ("--config.data.cache_dir={tmp}/a.txt", "--split=test"), r"is a file, not a folder"),
    )),
    Case("eval: a byte budget for an encoder", "eval", ("--workdir={enc}", "--config.eval.max_bytes=64"),
         r"eval.max_bytes=64 is for decoders: an encoder is scored on whole rows of tokens"),
    Case("eval: a recall-task run", "eval", ("--workdir={mqar}",), r"generated recall task 'mqar'.*longctx-recall"),
    Case("eval: workdir is a file", "eval", ("--workdir={tmp}/a.txt",), r"is a file, not a run folder"),
    Case("sample: workdir is a file", "sample", ("--workdir={tmp}/a.txt",), r"is a file, not a run folder"),
    # longctx-train: the range of every numeric key
    *(Case(f"range: {key}={value}", "train", (*T, f"--config.{key}={value}"), expect) for key, value, expect in (
        ("eval.stride", "-4", r"eval.stride=-4 must be an integer >= 1, or 0"),
        ("eval.context", "-1", r"eval.context=-1 must be"),
        ("eval.window", "-3", r"eval.window=-3 must be"),
        ("eval.row_len", "-7", r"eval.row_len=-7 must be"),
        ("train.grad_clip", "-1", r"grad_clip=-1.0 must be a finite number >= 0 \(0 = no clipping\)"),
        ("train.grad_clip", "inf", r"grad_clip=inf must be a finite number"),
        ("train.b1", "1.0", r"b1=1.0 must be in \[0, 1\)"),
        ("train.b2", "1.5", r"b2=1.5 must be in \[0, 1\)"),
        ("train.b2", "-0.1", r"b2=-0.1 must be in \[0, 1\)"),
        ("train.eps", "0", r"eps=0.0 must be a finite number > 0"),
        ("train.weight_decay", "-5", r"weight_decay=-5.0 must be a finite number >= 0"),
        ("train.weight_decay", "nan", r"weight_decay=nan must be"),
        ("train.lr", "nan", r"lr=nan must be positive"),
        ("train.lr", "inf", r"lr=inf must be positive"),
        ("train.min_lr_ratio", "2", r"min_lr_ratio=2.0 must be in \[0, 1\]"),
        ("train.eval_tokens", "0", r"eval_tokens=0 must be a positive integer"),
        ("train.eval_tokens", "-8", r"eval_tokens=-8 must be a positive integer"),
        ("train.seed", "-1", r"train.seed=-1 must be an integer >= 0"),
        ("train.steps", "0", r"train.steps=0 must be a positive integer"),
        ("train.batch_size", "0", r"batch_size=0 must be a positive integer"),
        ("train.seq_len", "-32", r"seq_len=-32 must be a positive integer"),
        ("train.window", "-8", r"window=-8 must be an integer >= 0"),
        ("train.log_every", "0", r"log_every=0 must be a positive integer"),
        ("train.eval_every", "-1", r"eval_every=-1 must be a positive integer"),
        ("train.ckpt_every", "0", r"ckpt_every=0 must be a positive integer"),
        ("train.keep_checkpoints", "0", r"keep_checkpoints=0 must be a positive integer"),
        ("train.max_skipped_in_row", "0", r"max_skipped_in_row=0 must be a positive integer"),
        ("train.short_steps", "-1", r"short_steps=-1 must be an integer >= 0"),
        ("mesh.data", "0", r"mesh.data=0 must be an integer >= 1, or -1"),
        ("mesh.data", "-2", r"mesh.data=-2 must be an integer >= 1, or -1"),
        ("mesh.fsdp", "0", r"mesh.fsdp=0 must be >= 1"),
        ("mesh.sequence", "-1", r"mesh.sequence=-1 must be >= 1"),
        ("model.d_model", "0", r"d_model=0 must be a positive integer"),
        ("model.num_layers", "-1", r"num_layers=-1 must be a positive integer"),
        ("model.num_heads", "0", r"num_heads=0 must be a positive integer"),
        ("model.d_ff", "0", r"d_ff=0 must be a positive integer"),
        ("model.vocab_size", "-1", r"vocab_size=-1 must be an integer >= 0"),
        ("model.max_len", "-1", r"max_len=-1 must be an integer >= 0"),
        ("model.loss_chunk", "-1", r"loss_chunk=-1 must be an integer >= 0"),
        ("model.dropout", "-0.1", r"dropout=-0.1 must be in \[0, 1\)"),
        ("model.dropout", "nan", r"dropout=nan must be in \[0, 1\)"),
        ("model.gau_expansion", "0", r"gau_expansion=0.0 must be a finite number > 0"),
        ("model.adaptive_div", "0.5", r"adaptive_div=0.5 must be a finite number >= 1"),
        ("eval.batch_size", "0", r"eval.batch_size=0 must be a positive integer"),
        ("eval.max_tokens", "-1", r"max_tokens=-1 must be"),
        ("eval.max_bytes", "-1", r"max_bytes=-1 must be an integer >= 0 \(0 = no byte budget\)"),
        ("sample.temperature", "nan", r"temperature=nan must be a finite number"),
        ("sample.num_tokens", "0", r"num_tokens=0 must be a positive integer"),
        ("data.options.vocab_size", "-1", r"options.vocab_size=-1 must be an integer >= 0"),
        ("mlm.rate", "1.5", r"mlm.rate=1.5 must be in \(0, 1\)"),
        ("mlm.max_span_len", "0", r"max_span_len=0 must be an integer >= 1"),
        ("mlm.mask_id", "-2", r"mask_id=-2 must be an integer >= 0, or -1"),
    )),
    Case("train: two eval budgets", "train", (*T, "--config.eval.max_tokens=10", "--config.eval.max_bytes=64"),
         r"eval.max_tokens=10 and eval.max_bytes=64: give one budget and set the other to 0"),
    # longctx-train: the workdir and the data cache
    Case("workdir is a file", "train", ("--config={cfg}", "--workdir={tmp}/a.txt"), r"exists and is not a folder"),
    Case("workdir under a file", "train", ("--config={cfg}", "--workdir={tmp}/a.txt/w"),
         r"cannot create --workdir .*Not a directory"),
    Case("config.json of the workdir a folder", "train", ("--config={cfg}", "--workdir={tmp}/cfgdir"),
         r"cannot write .*config.json \(Is a directory\)"),
    Case("data.cache_dir a file", "train", (*T, "--config.data.cache_dir={tmp}/a.txt"), r"data.cache_dir .* is a file"),
    Case("metrics.jsonl of the workdir not text", "train", ("--config={cfg}", "--workdir={tmp}/badmetrics"),
         r"cannot rewrite .*metrics.jsonl for the resume"),
    Case("pg19 metadata.csv but no books", "train",
         (*T, "--config.data.source=pg19", "--config.data.tokenizer=sentencepiece", "--config.data.path={tmp}/pg19nobooks"),
         r"pg19: .*train holds no <book_id>.txt books"),
    Case("sample: beyond the learned positions", "sample", ("--workdir={learned}", "--num_tokens=100"),
         r"exceed the model's learned positions \(model.max_len=32\)"),
    Case("wikitext103 files empty", "train",
         (*T, "--config.data.source=wikitext103", "--config.data.tokenizer=words", "--config.data.path={tmp}/wt_empty"),
         r"wikitext103: .* are empty"),
    Case("wikitext103 files binary", "train",
         (*T, "--config.data.source=wikitext103", "--config.data.tokenizer=words", "--config.data.path={tmp}/wt_binary"),
         r"wikitext103: .*line 1 is not UTF-8 text"),
    # longctx-prepare
    Case("prepare: a generated recall task", "prepare",
         ("--config={cfg}", "--config.data.source=mqar", "--config.data.synthetic.num_pairs=4"),
         r"generated recall task: .*nothing to prepare"),
    Case("prepare: negative seed", "prepare", ("--config={cfg}", "--config.train.seed=-1"), r"seed=-1 must be"),
    Case("prepare: data.cache_dir a file", "prepare", ("--config={cfg}", "--config.data.cache_dir={tmp}/a.txt"),
         r"is a file, not a folder"),
    # longctx-fill and longctx-recall
    Case("fill: text not UTF-8", "fill", ("--workdir={enc}", "--text=ab\udcff_"), r"text to fill is not UTF-8"),
    Case("fill: a decoder run", "fill", ("--workdir={run}", "--text=a_b"), r"needs an encoder run"),
    Case("recall: zero rows", "recall", ("--workdir={mqar}", "--rows=0"), r"--rows=0 must be a positive integer"),
    Case("recall: negative length", "recall", ("--workdir={mqar}", "--length=-5"), r"--length=-5 must be a positive"),
    Case("recall: zero bins", "recall", ("--workdir={mqar}", "--bins=0"), r"--bins=0 must be a positive"),
    # longctx-bench
    Case("bench: unknown sub-command", "bench", ("speed",), r"invalid choice: 'speed'"),
    Case("bench: unknown flag", "bench", ("report", "--fast"), r"unrecognized arguments: --fast"),
    # your own corpus (data.source='files' / 'hf', data.tokenizer='hf')
    Case("files: an empty corpus", "train", (*T, "--config.data.source=files", "--config.data.path={tmp}/nofiles"),
         r"files: .*is an empty folder: the corpus is empty"),
    Case("files: JSONL without the text field", "train",
         (*T, "--config.data.source=files", "--config.data.path={tmp}/nofield.jsonl"),
         r"nofield.jsonl line 1 has no field 'text' \(its fields: body\); set data.options.text_field"),
    Case("files: text not UTF-8", "train", (*T, "--config.data.source=files", "--config.data.path={tmp}/latin1.txt"),
         r"latin1.txt is not UTF-8 text .*convert it to UTF-8"),
    Case("files: split fractions over 1", "train",
         (*T, "--config.data.source=files", "--config.data.path={tmp}/latin1.txt", "--config.data.options.split=(0.9,0.2,0.1)"),
         r"data.options.split=\(0.9, 0.2, 0.1\) must be three fractions"),
    Case("hf: a Hub dataset name", "train", (*T, "--config.data.source=hf", "--config.data.path=Salesforce/wikitext"),
         r"data.path='Salesforce/wikitext' is not a local file or folder; .*never downloads from the Hub"),
    Case("hf: a tokenizer file that does not parse", "train",
         (*T, "--config.data.tokenizer=hf", "--config.data.options.tokenizer_file={tmp}/a.txt"),
         r"a.txt is not a Hugging Face tokenizer file .*expected a tokenizer.json"),
    Case("hf: tokenizer file not set", "prepare", ("--config={cfg}", "--config.data.tokenizer=hf"),
         r"set data.options.tokenizer_file"),
    Case("vocabulary larger than the model's", "train", (*T, "--config.model.vocab_size=100"),
         r"model.vocab_size=100 is smaller than the tokenizer's 256"),
    Case("unknown packing rule", "train", (*T, "--config.data.packing=greedy"),
         r"choose one of: auto, document, pack, segments"),
    Case("packed rows with a method setting that cannot restart at a boundary", "train",
         (*T, "--config.data.packing=segments", "--config.model.attention.name=fma",
          "--config.model.attention.fma.release_zero_slots=true"), r"fma: packed rows .* release_zero_slots"),
    Case("validation streams longer than the state holds (refused before the first step)", "train",
         (*T, "--config.model.attention.name=fma", "--config.model.attention.fma.m=8", "--config.model.attention.fma.p=2",
          "--config.eval.row_len=-1"), r"max_len=32.*the evaluation carries the state through [0-9,]+ tokens"),
    Case("packed rows from a corpus of one document", "train",
         (*T, "--config.data.packing=segments", "--config.data.source=files", "--config.data.options.train_path={tmp}/a.txt",
          "--config.data.options.valid_path={tmp}/a.txt"), r"train split is one document"),
]


def make_context(root: Path) -> dict:
    """A trained tiny run and the bad files the cases point at."""
    from tests.conftest import tiny_config, write_corpus

    cfg = tiny_config(write_corpus(root / "corpus"), root / "cache", steps=2, warmup_steps=1, eval_every=100)
    cfg_file = root / "tiny.py"
    cfg_file.write_text(f"import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    from longctx.train.loop import train

    enc = ml_collections.ConfigDict(cfg.to_dict())
    enc.model.kind = "encoder"
    mqar = ml_collections.ConfigDict(cfg.to_dict())
    mqar.data.source, mqar.data.path = "mqar", ""
    mqar.data.synthetic.update({"num_pairs": 4, "num_keys": 8, "num_values": 8, "eval_rows": 8, "bins": 2})
    fma = ml_collections.ConfigDict(cfg.to_dict())
    fma.model.attention.name = "fma"
    fma.model.attention.fma = ml_collections.ConfigDict({"m": 8, "p": 2, "max_len": 64})
    fma.execution.attention.fma.impl = "xla"
    learned = ml_collections.ConfigDict(cfg.to_dict())
    learned.model.positions = "learned"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for c, name in ((cfg, "run"), (enc, "enc"), (mqar, "mqar"), (fma, "fma"), (learned, "learned")):
            train(c, root / name, progress=False)
    shutil.copytree(root / "run", root / "other")
    (root / "other" / "samples").write_text("not a folder")
    tmp = root / "tmp"
    for d in ("nofiles", "empty", "truncated", *(f"{p}/{s}" for p in ("pg19", "pg19latin1", "pg19nobooks")
                                                  for s in ("train", "validation", "test"))):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    (tmp / "empty" / "enwik8.zip").write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(tmp / "full.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", bytes(range(256)) * 400)
    (tmp / "truncated" / "enwik8.zip").write_bytes((tmp / "full.zip").read_bytes()[:300])
    (tmp / "pg19" / "metadata.csv").write_text("123,Title\n")
    (tmp / "pg19nobooks" / "metadata.csv").write_text("123,Title,1900,http://x\n")
    (tmp / "pg19latin1" / "metadata.csv").write_bytes("123,Caf\xe9 au lait,1900,http://x\n".encode("latin-1"))
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "a.txt").write_text("a")
    (tmp / "nofield.jsonl").write_text('{"body": "a JSONL line without the text field"}\n')
    (tmp / "raises.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp / "getraises.py").write_text("def get_config():\n    return 1 / 0\n")
    (tmp / "noget.py").write_text("X = 1\n")
    (tmp / "cfgdir" / "config.json").mkdir(parents=True)
    (tmp / "badmetrics").mkdir()
    (tmp / "badmetrics" / "metrics.jsonl").write_bytes(bytes(range(128, 256)))
    for name, content in (("wt_empty", b""), ("wt_binary", bytes(range(128, 256)) * 8)):
        (tmp / name).mkdir()
        for split in ("train", "valid", "test"):
            (tmp / name / f"wiki.{split}.tokens").write_bytes(content)
    return {"cfg": str(cfg_file), "run": str(root / "run"), "other": str(root / "other"), "tmp": str(tmp),
            "enc": str(root / "enc"), "mqar": str(root / "mqar"), "fma": str(root / "fma"),
            "learned": str(root / "learned")}


def run_case(case: Case, ctx: dict) -> tuple[int, str]:
    from longctx import cli
    from longctx.bench import cli as bench_cli

    entry = {"train": cli.train_main, "prepare": cli.prepare_main, "eval": cli.eval_main, "sample": cli.sample_main,
             "fill": cli.fill_main, "recall": cli.recall_main}
    args = [a.format(**ctx) for a in case.args]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = bench_cli.main(args) if case.cmd == "bench" else entry[case.cmd]([f"longctx-{case.cmd}", *args])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def error_line(stderr: str) -> str | None:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return lines[0] if len(lines) == 1 and "Traceback" not in stderr else None


# one worker for the module: its context (five tiny trained runs) is built once, not once per xdist worker
pytestmark = pytest.mark.xdist_group("bad_inputs")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return make_context(tmp_path_factory.mktemp("bad_inputs"))


def test_at_least_130_distinct_cases():
    assert len(CASES) >= 130 and len({c.id for c in CASES}) == len(CASES)
    assert {c.cmd for c in CASES} == {"train", "prepare", "eval", "sample", "fill", "recall", "bench"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, ctx):
    code, err = run_case(case, ctx)
    line = error_line(err)
    assert code == 2 and line is not None, (code, err[-3000:])
    assert re.search(case.expect, line), line
    if case.cmd == "sample":
        assert not any((Path(ctx[k]) / "samples").exists() for k in ("run", "enc", "fma", "learned"))  # nothing written
    assert not (Path(ctx["tmp"]) / "a.txt").is_dir() and (Path(ctx["tmp"]) / "a.txt").read_text() == "a"
    # the docs/errors.md row is the one generated from this message (no row edited by hand)
    row = doc_row(case, err, ctx)
    doc = (ROOT / "docs" / "errors.md").read_text().splitlines()
    assert row in doc, f"regenerate docs/errors.md (python -m tests.test_bad_inputs > docs/errors.md): {row}"


def test_an_fma_run_streams_past_its_levels_with_the_truncated_window(ctx, tmp_path):
    """The way out the refusals above name: a trained fma run (levels for 64 tokens) takes
    ``allow_truncated_window`` for sampling and a whole-file stream (no new parameter: each query reaches back 32
    to 64 tokens); its other settings stay fixed."""
    wd = str(shutil.copytree(ctx["fma"], tmp_path / "fma"))
    flag = "--config.model.attention.fma.allow_truncated_window=true"
    for cmd, args in (("sample", ("--num_tokens=200", "--seed=1")), ("eval", ("--config.eval.row_len=-1",
                                                                              "--config.eval.max_tokens=300"))):
        code, err = run_case(Case(f"fma {cmd}", cmd, (f"--workdir={wd}", flag, *args), ""), ctx)
        assert code in (0, None) and "error" not in err, err[-2000:]
    code, err = run_case(Case("fma m", "eval", (f"--workdir={wd}", "--config.model.attention.fma.m=4"), ""), ctx)
    assert code == 2 and "allow_truncated_window" in error_line(err)


def test_eval_prints_its_result_before_a_failed_write(ctx, tmp_path):
    """The score is on stdout before the JSON is written; a write that fails (here WORKDIR/eval is a
    file) is one error line, and the JSON is written whole or not at all."""
    from longctx import cli

    wd = Path(shutil.copytree(ctx["run"], tmp_path / "run"))
    (wd / "eval").write_text("not a folder")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--config.eval.max_tokens=64"])
    assert e.value.code == 2 and error_line(err.getvalue()) is not None, err.getvalue()
    assert "could not be written" in error_line(err.getvalue())
    assert "bits per token" in out.getvalue()
    (wd / "eval").unlink()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--config.eval.max_tokens=64"]) == 0
    names = [p.name for p in (wd / "eval").iterdir() if p.suffix == ".json"]
    assert len(names) == 1 and names[0].startswith("valid_step2_") and names[0].endswith("-n64.json")  # no temporaries
    assert json.loads((wd / "eval" / names[0]).read_text())["step"] == 2


def test_a_full_disk_while_preparing_data_is_one_line(ctx, tmp_path, monkeypatch):
    """ENOSPC injected into the token writer: one line naming the split and the cause, exit 2."""
    import errno

    from longctx import cli
    from longctx.data import prepare as prepare_lib

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_lib, "prepare_split", full)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.prepare_main(["longctx-prepare", f"--config={ctx['cfg']}", f"--config.data.cache_dir={tmp_path / 'c'}"])
    line = error_line(err.getvalue())
    assert e.value.code == 2 and line is not None and "the disk is full" in line, err.getvalue()


def test_a_full_disk_when_eval_writes_keeps_the_printed_result(ctx, tmp_path, monkeypatch):
    import errno

    from longctx import cli, evaluate

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate, "write_json_atomic", full)
    wd = Path(shutil.copytree(ctx["run"], tmp_path / "run"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--config.eval.max_tokens=64"])
    line = error_line(err.getvalue())
    assert e.value.code == 2 and line is not None and "No space left" in line, err.getvalue()
    assert "bits per token" in out.getvalue()


def test_errors_doc_lists_every_case():
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [c.id for c in CASES if f"| {c.id} |" not in doc]
    assert not missing, f"regenerate docs/errors.md (python -m tests.test_bad_inputs > docs/errors.md): {missing}"


PLACEHOLDERS = {"cfg": "tiny.py", "run": "runs/tiny", "other": "runs/tiny", "tmp": "/tmp/x", "enc": "runs/tiny_mlm",
                "mqar": "runs/tiny_mqar", "fma": "runs/tiny_fma", "learned": "runs/tiny_learned"}


def command_line(case: Case) -> str:
    placeholders = PLACEHOLDERS
    args = " ".join(a.format(**placeholders).replace("\udcff", "\\xff") for a in case.args)
    return f"longctx-{case.cmd} {args}".replace("|", "\\|")


def doc_row(case: Case, stderr: str, ctx: dict) -> str:
    line = (error_line(stderr) or "(no single error line)").removeprefix("error: ")
    for key, value in ctx.items():
        line = line.replace(str(Path(value).resolve()), PLACEHOLDERS[key]).replace(value, PLACEHOLDERS[key])
    return f"| {case.id} | `{command_line(case)}` | {line.replace('|', '/')} |"


def generate_doc() -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ctx = make_context(Path(d))
        rows = []
        for case in CASES:
            _, err = run_case(case, ctx)
            rows.append(doc_row(case, err, ctx))
    head = ("# Errors\n\nEvery bad input is answered with one line on stderr (`error: ...`, what is wrong and what is\n"
            "allowed) and exit status 2, never a traceback. This table is generated from the cases of\n"
            "`tests/test_bad_inputs.py` (`.venv/bin/python -m tests.test_bad_inputs > docs/errors.md`), which\n"
            "checks each of them. `tiny.py` is a tiny config, `runs/tiny` a trained run (`runs/tiny_mlm` an\n"
            "encoder, `runs/tiny_mqar` a run on the mqar recall task, `runs/tiny_fma` an fma run whose levels\n"
            "cover 64 tokens, `runs/tiny_learned` one with 32 learned positions), `/tmp/x` a folder of bad files (an empty or truncated `enwik8.zip`, a\n"
            "`metadata.csv` with a bad row or in Latin-1, a Latin-1 prompt, WikiText-103 files that are empty or\n"
            "binary, a file `a.txt`).\n\n"
            "| case | command | message |\n|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(generate_doc())
