"""Stopping the servers a benchmark started: SIGTERM (a clean shutdown), then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Ask `proc` to exit; kill it if it has not within `timeout` seconds; reap it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
