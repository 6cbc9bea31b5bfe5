"""Quire's version (pyproject.toml's), importable from any floor."""

__version__ = "0.1.0"
