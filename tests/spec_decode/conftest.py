"""Speculative decoding test fixtures (helpers in spec_helpers.py, imported by name)."""

from __future__ import annotations

import pytest

from spec_helpers import make_models


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("spec"))
