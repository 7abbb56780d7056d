"""Benchmarks of the attention methods: ``longctx-bench {attention,decode,quality,train}``
(see ``longctx/bench/cli.py``) and ``python -m longctx.bench.report`` (BENCHMARKS.md)."""
