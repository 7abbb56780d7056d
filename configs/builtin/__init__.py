"""Configs on the built-in corpus (the Python standard library sources): one per attention method."""
