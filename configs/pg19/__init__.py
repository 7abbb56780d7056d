"""PG-19 configs (SentencePiece)."""
