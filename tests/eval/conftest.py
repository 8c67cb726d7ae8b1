"""Fixtures for tests/eval (defined in evalkit.py)."""

from evalkit import sets_root  # noqa: F401
