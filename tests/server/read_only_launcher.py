"""`quire` as if the root filesystem were read-only, except for the folders named in
QUIRE_TEST_WRITABLE (os.pathsep-separated): the pod's writable emptyDir mounts.

Unprivileged tests cannot remount / read-only (and as root, file modes stop no write), so a
Python audit hook stands in: every write this process makes through Python (open for writing,
os.open with a write flag, mkdir, rename/replace, remove, rmdir, rmtree, chmod, symlink) outside
those folders fails with EROFS, as the kernel would answer, and is recorded, one line each, in
QUIRE_TEST_WRITE_LOG. What it cannot see: writes made by native code inside this process (torch's
C++, a C extension) and by child processes (the C++ compiler, which gets TMPDIR and an output
path from us). Everything else is the real `quire serve`.
"""

import errno
import os
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Device files a read-only root still lets a process write (they are not on the root's disk).
_ALWAYS_WRITABLE = ("/dev/null", "/dev/shm", "/dev/tty", "/proc/self", f"/proc/{os.getpid()}")
_allowed = tuple(os.path.realpath(p) for p in os.environ["QUIRE_TEST_WRITABLE"].split(os.pathsep) if p)
_log = open(os.environ["QUIRE_TEST_WRITE_LOG"], "a", buffering=1)  # before the hook exists


def _inside(path) -> bool:
    if isinstance(path, int):  # a file descriptor: opened (and checked) earlier
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.fspath(path))
    return any(real == root or real.startswith(root + os.sep)
               for root in _allowed + _ALWAYS_WRITABLE)


def _wants_write(event: str, args: tuple) -> list:
    """The paths this event would write, or []."""
    if event == "open":
        path, mode, flags = args
        if path is None:
            return []
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
                 (isinstance(flags, int) and flags & _WRITE_FLAGS)
        return [path] if writes else []
    if event in ("os.mkdir", "os.remove", "os.rmdir", "os.chmod", "os.truncate", "os.utime",
                 "shutil.rmtree"):
        return [args[0]]
    if event in ("os.rename", "os.link", "os.symlink"):
        return [args[0], args[1]] if event == "os.rename" else [args[1]]
    return []


def _hook(event: str, args: tuple) -> None:
    if event not in ("open", "os.mkdir", "os.remove", "os.rmdir", "os.chmod", "os.truncate",
                     "os.utime", "shutil.rmtree", "os.rename", "os.link", "os.symlink"):
        return
    for path in _wants_write(event, args):
        if not _inside(path):
            _log.write(f"{event} {path!r}\n")
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))


sys.addaudithook(_hook)

if __name__ == "__main__":
    from quire.entrypoints.cli import main
    sys.exit(main())
