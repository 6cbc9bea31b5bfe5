"""Fixtures for the engine's unit tests: no model, no tensors (helpers in engine_fakes.py)."""

from __future__ import annotations

import pytest

from engine_fakes import FakeEngine


@pytest.fixture
def engine_factory():
    """FakeEngine(...) keyword arguments in, a fresh engine out."""
    return FakeEngine
