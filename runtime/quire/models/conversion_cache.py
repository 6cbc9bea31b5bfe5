"""Housekeeping of the GGUF conversion cache (the cache's `gguf` folder, by default
~/.cache/quire/gguf; quire/writable_dirs.py says where): each folder records the
file it was made from, and a new conversion removes the folders that can never be read again;
a folder whose weights file is cut short is found before it is read (and made again: the GGUF
is the source of truth, the folder only a faster copy of it).

A folder's key is the GGUF's path, size and mtime (models/loader.py), so reinstalling the same
package (a new venv, a new mtime) makes a new ~100-600 MB folder and the old one is never hit
again. A folder is stale when the file it records is gone or has another size or mtime; only
those are removed, so two installs side by side keep their folders. Folders without a record
(made by an older Quire) are left alone: nothing says what they came from. A conversion killed
mid-way leaves `<folder>.tmp-<pid>`; those whose process is gone are removed too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

logger = logging.getLogger(__name__)

SOURCE_RECORD = "quire_source.json"
_TMP = ".tmp-"  # what a conversion in progress appends to its folder's name, then its pid


def temp_path(path: str) -> str:
    """Where this process writes `path` before renaming it into place."""
    return f"{path}{_TMP}{os.getpid()}"


def record_source(folder: str, path: str, st: os.stat_result) -> None:
    """Write (atomically) which file `folder` was made from, unless it says so already."""
    target = os.path.join(folder, SOURCE_RECORD)
    if os.path.exists(target):
        return
    tmp = temp_path(target)
    with open(tmp, "w") as f:
        json.dump({"path": os.path.abspath(path), "size": st.st_size,
                   "mtime_ns": st.st_mtime_ns}, f)
    os.replace(tmp, target)


def intact(folder: str) -> bool:
    """Whether the folder's config and safetensors files are all there and every safetensors
    file is as long as its header says (a cheap check: the header only, not the data)."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        return False
    try:
        files = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return False
                size = int.from_bytes(head, "little")
                header = json.loads(f.read(size))
            end = max((int(t["data_offsets"][1]) for k, t in header.items()
                       if k != "__metadata__"), default=0)
            if os.path.getsize(path) != 8 + size + end:
                return False
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    return bool(files)


def _is_stale(folder: str) -> bool:
    try:
        with open(os.path.join(folder, SOURCE_RECORD)) as f:
            rec = json.load(f)
        path, size, mtime_ns = rec["path"], int(rec["size"]), int(rec["mtime_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no record (an older Quire's folder) or an unreadable one: keep it
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # cannot tell (permissions): keep it
    return st.st_size != size or st.st_mtime_ns != mtime_ns


def _orphaned_tmp(name: str) -> bool:
    """`<folder>.tmp-<pid>` whose converting process no longer exists."""
    _, sep, pid = name.rpartition(_TMP)
    if not sep or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else
        pass
    return False


def collect_stale(cache_dir: str, keep: str) -> list[str]:
    """Remove the folders under `cache_dir` that can never be read again (never `keep`);
    returns what was removed. Never raises: housekeeping must not fail a load."""
    removed = []
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return removed
    for name in sorted(names):
        folder = os.path.join(cache_dir, name)
        if os.path.abspath(folder) == os.path.abspath(keep) or not os.path.isdir(folder):
            continue
        if _orphaned_tmp(name) or _is_stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                removed.append(folder)
                logger.info("removed the stale GGUF conversion %s (its source file is gone "
                            "or changed)", folder)
    return removed
