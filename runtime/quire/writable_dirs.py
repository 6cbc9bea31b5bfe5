"""Where the runtime writes, found from the standard variables: its cache (GGUF conversions,
native kernel builds) and temporary files.

A pod with a read-only root filesystem may write only to the volumes it mounts; the operator
mounts emptyDirs and points HOME, XDG_CACHE_HOME and TMPDIR at them. Elsewhere the usual
defaults hold (~/.cache, /tmp).

- The cache: $QUIRE_CACHE_DIR ("" turns it off), else $XDG_CACHE_HOME/quire, else
  $HOME/.cache/quire. Where that cannot be written, a temporary folder of the process's own
  stands in (removed at exit), with one warning naming the folder and the variables: each start
  then converts its GGUF and builds its kernels again, which is still several times faster than
  reading a GGUF directly. With the cache off, GGUFs are read directly and kernels are built in
  that temporary folder.
- Temporary files: Python's tempfile rules ($TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp, the
  working directory). Where none of those can be written, a `tmp` folder in the cache is used
  (and TMPDIR set to it, for child processes); where that cannot be written either,
  `ensure_temp_dir` raises one error that names both and the variables. It runs when `quire` is
  imported, because importing torch already needs a temporary folder.
"""

from __future__ import annotations

import ast
import atexit
import errno
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

CACHE_ENV = "QUIRE_CACHE_DIR"


class NoWritableDirectory(OSError):
    """Neither a temporary folder nor the cache can be written."""


def cache_root() -> str | None:
    """The cache's folder, created (see the module's docstring); None when QUIRE_CACHE_DIR is ""."""
    if os.environ.get(CACHE_ENV) == "":
        return None
    root, source = configured_cache_root()
    if root is not None and root in _writable:
        return root
    if (root, source) in _warned:  # found unwritable before
        return os.path.join(_process_dir(), "cache")
    problem = "there is no home folder" if root is None else _unwritable(root)
    if problem is None:
        _writable.add(root)
        return root
    fallback = os.path.join(_process_dir(), "cache")
    _warned.add((root, source))
    logger.warning("the cache folder %s (%s) cannot be written (%s); using %s for this "
                   "process only: set %s or XDG_CACHE_HOME to a writable folder to keep "
                   "GGUF conversions and kernel builds across restarts",
                   root or "", source, problem, fallback, CACHE_ENV)
    return fallback


def kernel_cache_dir() -> str:
    """Where native kernels are built: the cache's `kernels` folder, or with the cache off a
    temporary folder of this process's own."""
    root = cache_root()
    return os.path.join(root if root is not None else _process_dir(), "kernels")


def configured_cache_root() -> tuple[str | None, str]:
    """(the cache folder the environment names, which variable named it); None when
    QUIRE_CACHE_DIR is "" or there is no home folder to put it in."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit is not None:
        return (explicit or None), f"${CACHE_ENV}"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return os.path.join(xdg, "quire"), "$XDG_CACHE_HOME/quire"
    home = os.path.expanduser("~")
    if home == "~":  # no $HOME and no passwd entry (an arbitrary uid)
        return None, "$HOME/.cache/quire"
    return os.path.join(home, ".cache", "quire"), "$HOME/.cache/quire"


def ensure_temp_dir() -> str:
    """A folder that tempfile can write in (see the module's docstring), or NoWritableDirectory."""
    try:
        return tempfile.gettempdir()
    except FileNotFoundError as e:  # tempfile tried every candidate; none took a file
        tried = _listed(str(e))
    root, source = configured_cache_root()
    fallback = None if root is None else os.path.join(root, "tmp")
    problem = "there is no home folder" if fallback is None else _unwritable(fallback)
    if problem is None:
        tempfile.tempdir = os.environ["TMPDIR"] = fallback
        logger.warning("no writable temporary folder (tried %s); using %s", tried, fallback)
        return fallback
    where = f"the cache's {fallback} (from {source})" if fallback else f"a cache folder ({source})"
    raise NoWritableDirectory(
        errno.EROFS,
        f"no writable folder for temporary files: TMPDIR is {os.environ.get('TMPDIR') or 'unset'}; "
        f"tried {tried} and {where}: {problem}. Mount a writable volume (in Kubernetes an "
        "emptyDir) and point TMPDIR at it (and XDG_CACHE_HOME, for the caches)")


def _listed(message: str) -> str:
    """tempfile's "No usable temporary directory found in ['/tmp', ...]" as "/tmp, ..."."""
    try:
        return ", ".join(ast.literal_eval(message.partition(" found in ")[2]))
    except (ValueError, SyntaxError, TypeError):
        return "$TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory"


_writable: set[str] = set()  # probed once per folder
_warned: set[tuple[str | None, str]] = set()
_process_folder: str | None = None


def _process_dir() -> str:
    """A temporary folder of this process's own, removed at exit."""
    global _process_folder
    if _process_folder is None:
        _process_folder = tempfile.mkdtemp(prefix="quire-")
        atexit.register(shutil.rmtree, _process_folder, ignore_errors=True)
    return _process_folder


def _unwritable(folder: str) -> str | None:
    """Why a file cannot be made in `folder` (created if missing), or None. Tried for real:
    permission bits say nothing of a read-only filesystem, nor anything to root."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".quire-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
