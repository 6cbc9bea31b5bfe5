"""The tier settings (vLLM's names) from EngineArgs, checked before anything loads.

    --kv-offloading-backend native --kv-offloading-size GiB     host RAM
    --kv-offloading-disk-path DIR --kv-offloading-disk-size GiB  disk (both or neither)
    --kv-offloading-remote redis://host:port                     shared Redis / Valkey

A bad value raises QuireValidationError naming its setting (the CLI turns it into one line
naming the flag, exit 2).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

from quire.validation import QuireValidationError

BACKENDS = ("native",)
REMOTE_SCHEMES = ("redis", "rediss", "valkey", "valkeys")
GIB = 1 << 30


@dataclass(frozen=True)
class KVOffloadConfig:
    host_bytes: int | None
    disk_path: str | None
    disk_bytes: int | None
    remote_url: str | None

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_path or self.remote_url)

    @classmethod
    def from_args(cls, args) -> KVOffloadConfig:
        """From an EngineArgs (its kv_offloading_* fields); raises on bad input."""
        if args.kv_offloading_backend not in BACKENDS:
            raise QuireValidationError(
                "kv_offloading_backend", f"kv_offloading_backend must be one of "
                f"{', '.join(BACKENDS)}, got {args.kv_offloading_backend!r}",
                args.kv_offloading_backend)
        host = _gib("kv_offloading_size", args.kv_offloading_size)
        disk = _gib("kv_offloading_disk_size", args.kv_offloading_disk_size)
        path = args.kv_offloading_disk_path
        if (path is None) != (disk is None):
            given, missing = (("kv_offloading_disk_path", "kv_offloading_disk_size")
                              if disk is None else
                              ("kv_offloading_disk_size", "kv_offloading_disk_path"))
            raise QuireValidationError(missing, f"{given} needs {missing} too")
        if path is not None:
            _check_writable_dir(path)
        remote = args.kv_offloading_remote
        if remote is not None:
            check_remote_url(remote)
        config = cls(host, path, disk, remote)
        if config.enabled:
            if not args.enable_prefix_caching:
                raise QuireValidationError(
                    "enable_prefix_caching", "KV offloading tiers keep prefix-cache blocks: "
                    "they need enable_prefix_caching on")
            for name in ("tensor_parallel_size", "pipeline_parallel_size"):
                if getattr(args, name) > 1:
                    raise QuireValidationError(
                        name, f"KV offloading tiers are not supported with {name} > 1 yet")
        return config


def _gib(name: str, value: object) -> int | None:
    """A size in GiB (a positive number) -> bytes."""
    if value is None:
        return None
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)
    if not ok or int(value * GIB) < 1:
        raise QuireValidationError(name, f"{name} must be a positive number of GiB, got "
                                   f"{value!r}", value)
    return int(value * GIB)


def _check_writable_dir(path: object) -> None:
    """Made if missing, and a file written and removed there: only trying tells (root passes
    every os.access check, and a read-only mount or /proc refuses only at the write)."""
    name = "kv_offloading_disk_path"
    if not isinstance(path, str) or not path:
        raise QuireValidationError(name, f"{name} must be a folder path, got {path!r}", path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise QuireValidationError(name, f"{name} {path!r} is not a writable folder "
                                   f"({e.strerror or e})", path) from None


def check_remote_url(url: object, name: str = "kv_offloading_remote") -> None:
    """redis://host:port[/db] (rediss, valkey, valkeys too); raises naming `name`."""
    ok = isinstance(url, str)
    if ok:
        try:
            parts = urlsplit(url)
            port = parts.port  # ValueError when it is not a number in range
        except ValueError:
            ok = False
        else:
            db = parts.path.strip("/")
            ok = (parts.scheme in REMOTE_SCHEMES and bool(parts.hostname)
                  and port != 0 and (db == "" or db.isdigit())
                  and not parts.query and not parts.fragment)
    if not ok:
        raise QuireValidationError(
            name, f"{name} must be a URL like redis://host:6379 (schemes "
            f"{', '.join(REMOTE_SCHEMES)}; an optional /db number), got {url!r}", url)
