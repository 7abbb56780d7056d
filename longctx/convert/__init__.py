"""Pretrained models: Hugging Face folders to longctx runs and back (``longctx-convert``; docs/pretrained.md).

:mod:`longctx.convert.safetensors` reads and writes the tensors without torch, :mod:`longctx.convert.families`
holds what each model family's converter knows, :mod:`longctx.convert.core` does the conversion and
:mod:`longctx.convert.cli` is the command.
"""
