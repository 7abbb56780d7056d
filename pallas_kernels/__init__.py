"""Pallas kernels, each beside the pure-JAX reference it must match (DESIGN.md §3)."""
