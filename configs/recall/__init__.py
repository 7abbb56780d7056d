"""The recall benchmark configs (generated multi-query associative recall)."""
