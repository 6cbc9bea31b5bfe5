"""Suite-wide settings. `make test` runs the suite on two pytest-xdist workers: most tests are
tiny models, live servers and emulators that wait more than they compute, so two workers
overlap the waits; each worker's engines then take one CPU thread (QUIRE_NUM_THREADS, torch's
pool), so two workers on two cores never ask for more threads than there are CPUs. A test that
sets its own threads keeps them."""

from __future__ import annotations

import os


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("QUIRE_NUM_THREADS", "1")
        import torch
        torch.set_num_threads(1)
