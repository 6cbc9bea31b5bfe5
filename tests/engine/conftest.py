"""Engine unit tests: the bookkeeping alone, no model and no tensors (the fakes live in
engine_fakes.py, imported by name). Hypothesis runs the same bounded examples on every run and
machine: derandomized, no example database, and no deadline, so a slow machine can't fail."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("quire-engine", max_examples=150, deadline=None, derandomize=True,
                          database=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("quire-engine")
