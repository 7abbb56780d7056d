"""Benchmarks of the attention methods: ``longctx-bench {attention,decode,quality,train,step,kernels,profile,ab}``
and ``longctx-bench report`` (BENCHMARKS.md from the JSON in ``results/``); see ``longctx/bench/cli.py``."""
