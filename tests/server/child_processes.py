"""The tests' child processes end with the process that started them.

`die_with_parent(cmd)` is the command run through util-linux's `setpriv --pdeathsig`: the
kernel sends the child SIGTERM when the thread that started it ends (Linux's
PR_SET_PDEATHSIG), so a server a test worker started cannot outlive that worker, however it
ends (a crash, a kill, pytest-xdist tearing it down without running atexit handlers).
`survivors` finds the processes of this test session still alive: tests/conftest.py fails the
run with them at its end.
"""

from __future__ import annotations

import shutil

SESSION_MARK = "QUIRE_TEST_SESSION"  # in the environment of everything the session starts
# util-linux (Debian: essential); an absolute path, as some tests give the child a bare PATH
_SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
_shared: list = []  # stop() of the processes shared by several tests of this process


def share(process) -> None:
    """A process that outlives one test (started once, used by many): `stop_shared` ends it
    at this process's session end. A process one test owns is stopped by that test."""
    _shared.append(process)


def stop_shared() -> None:
    while _shared:
        _shared.pop().stop()


def die_with_parent(cmd: list) -> list[str]:
    """`cmd` run so that it gets SIGTERM when its parent goes away. Popen it from a thread that
    lives as long as the child should (the kernel watches the thread, not the process): the
    tests start servers from the main thread.

    Not a Popen `preexec_fn` (prctl in the forked child): Python code between fork and exec
    runs the at-fork handlers of whatever the test process holds, and with a gRPC server in
    it (the OTLP receiver) about 1 child in 100 aborted there ("Epoll1Poller encountered
    epoll_wait error: Bad file descriptor"). Without a preexec_fn, Popen execs at once
    (vfork), and setpriv sets the signal in the child before it execs `cmd` (it is kept across
    exec)."""
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *map(str, cmd)]


def survivors(mark: str, exclude: set[int]) -> list:
    """psutil Processes (not `exclude`, not zombies) whose environment carries this session's
    mark: every process the session started, and theirs, whoever their parent is now."""
    import psutil
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["pid"] in exclude or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(SESSION_MARK) == mark:
                found.append(proc)
        except (psutil.Error, OSError):
            continue  # gone, or another user's
    return found


def describe(proc) -> str:
    try:
        return f"pid {proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200]}"
    except Exception:
        return f"pid {proc.pid}"
