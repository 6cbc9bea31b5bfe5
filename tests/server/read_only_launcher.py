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
_allowed = tuple(os.path.realpath(p) for p in os.environ.get("QUIRE_TEST_WRITABLE", "").split(os.pathsep) if p)
_log = open(os.environ["QUIRE_TEST_WRITE_LOG"], "a", buffering=1)  # before the hook exists


def _where(path, dir_fd=None) -> str:
    """The absolute path an event names, also where it is relative to a folder's descriptor
    (shutil.rmtree removes names relative to the folder it opened)."""
    if isinstance(path, int):  # a descriptor: os.chmod(fd), os.truncate(fd)
        return os.readlink(f"/proc/self/fd/{path}")
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)


def _inside(path: str) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in _allowed + _ALWAYS_WRITABLE)


# audit event -> the (path, dir_fd) pairs in its arguments that it writes
_WRITES = {
    "os.mkdir": lambda path, mode, dir_fd: [(path, dir_fd)],
    "os.remove": lambda path, dir_fd: [(path, dir_fd)],
    "os.rmdir": lambda path, dir_fd: [(path, dir_fd)],
    "os.chmod": lambda path, mode, dir_fd: [(path, dir_fd)],
    "os.truncate": lambda path, length: [(path, None)],
    "os.utime": lambda path, times, ns, dir_fd: [(path, dir_fd)],
    "os.rename": lambda src, dst, src_fd, dst_fd: [(src, src_fd), (dst, dst_fd)],
    "os.link": lambda src, dst, src_fd, dst_fd: [(dst, dst_fd)],
    "os.symlink": lambda src, dst, dir_fd: [(dst, dir_fd)],
    "shutil.rmtree": lambda path, dir_fd: [(path, dir_fd)],
}


def _written(event: str, args: tuple) -> list:
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
            (isinstance(flags, int) and flags & _WRITE_FLAGS)
        # open(fd) wraps a descriptor opened before (a pipe, say): that open was the write
        return [(path, None)] if writes and isinstance(path, (str, bytes, os.PathLike)) else []
    return _WRITES[event](*args) if event in _WRITES else []


def _hook(event: str, args: tuple) -> None:
    for path, dir_fd in _written(event, args):
        where = _where(path, dir_fd)
        if not _inside(where):
            _log.write(f"{event} {where}\n")
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), where)


sys.addaudithook(_hook)

if __name__ == "__main__":
    from quire.entrypoints.cli import main
    sys.exit(main())
