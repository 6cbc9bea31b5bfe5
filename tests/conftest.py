"""Suite-wide settings. `make test` runs the suite on four pytest-xdist workers: most tests are
tiny models, live servers and emulators that wait more than they compute, so the workers
overlap the waits; each worker's engines take one CPU thread (QUIRE_NUM_THREADS, torch's pool),
so while all four compute they share the two cores rather than each spinning up a pool of its
own. A test that sets its own threads keeps them. Each test process freezes the modules its
collection imported out of the garbage collector's walk (pytest_collection_finish).

No process outlives the run: the session marks its environment (child_processes.SESSION_MARK,
inherited by the workers and everything they start); each worker stops the shared servers it
started at its session's end, and the run's own end (the controller, after the workers are
gone) fails the run, naming them, if any marked process is still alive after a grace period,
and then ends them."""

from __future__ import annotations

import gc
import os
import sys
import time
import uuid

import pytest

# servers given SIGTERM at a worker's end drain and exit within seconds
SURVIVOR_GRACE_S = float(os.environ.get("QUIRE_TEST_SURVIVOR_GRACE", "30"))


def pytest_configure(config):
    from child_processes import SESSION_MARK  # tests/server, on pytest's pythonpath
    # Quantized prefill on an AMX host's matrix engine rounds weights to bfloat16 when it
    # measures faster (native/matrix_engine.py): which it does would then depend on the host's
    # load, and a bfloat16 GGUF test comparing two chunkings would compare two paths. The
    # suite keeps every quantized matmul native; the tests of that path set it themselves.
    os.environ.setdefault("QUIRE_MATRIX_ENGINE", "0")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[SESSION_MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # a fresh run
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("QUIRE_NUM_THREADS", "1")
        import torch
        torch.set_num_threads(1)


def pytest_collection_finish(session):
    # The collector in a test process: collection imported torch's, transformers' and the
    # tests' modules (millions of objects), which every full collection walked again, and
    # the tests' engines, tokenizers and reference models allocate fast enough to run one
    # every few seconds. tests/runtime/test_parity.py, test_sampling.py and
    # tests/spec_decode/test_spec_exactness.py in one process (2-core Xeon): 28.5-29.1 s of
    # 156-161 s in the collector as it stands, 4.8-6.0 s with the modules frozen out of its
    # walk and a first generation of 10,000 (quire serve freezes its loaded heap the same way:
    # AsyncLLMEngine's freeze_gc). Objects still go when their last reference does.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _own_helpers() -> set[int]:
    """multiprocessing's resource tracker and fork server of this very process, started by the
    first tensor-parallel engine's workers when the tests run without xdist: they end when this
    process does (each reads its pipe to the end), so they are no survivors. Run without -n, a
    file of such tests otherwise waited 30 s here and failed."""
    from multiprocessing import forkserver, resource_tracker
    pids = (getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None))
    return {pid for pid in pids if pid}


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session, exitstatus):
    from child_processes import stop_shared
    stop_shared()  # (an xdist worker may never run atexit handlers)
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller checks, once every worker has ended
    from child_processes import SESSION_MARK, describe, survivors
    mark = os.environ.get(SESSION_MARK)
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    ours = {os.getpid(), *_own_helpers()}
    left = survivors(mark, ours)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = survivors(mark, ours)
    if not left:
        return
    lines = [f"{len(left)} process(es) started by this test run outlived it "
             f"({SURVIVOR_GRACE_S:.0f} s after its end); ending them:",
             *(f"  {describe(p)}" for p in left)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
    for proc in left:  # ours by the mark in their environment
        try:
            proc.kill()
        except Exception:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

