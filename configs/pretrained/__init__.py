"""Configs for runs that start from a pretrained model imported by longctx-convert (docs/pretrained.md)."""
