"""enwik8 configs (byte level)."""
