"""WikiText-103 configs (word level)."""
