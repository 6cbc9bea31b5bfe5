"""Writes to an LLMDeployment's status: serialized per object, and only when something changed.

Three writers share the status (reconcile, the Deployment watcher, the autoscaler), each from
its own kopf worker thread; a per-object lock and a fresh read keep one from undoing another.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from .kube import Kube

log = logging.getLogger(__name__)

_guard = threading.Lock()
_locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)


def _lock_for(namespace: str, name: str) -> threading.Lock:
    with _guard:
        return _locks[namespace, name]


def contains(whole: Any, part: Any) -> bool:
    """Whether merge-patching `whole` with `part` would change nothing."""
    if isinstance(part, Mapping):
        if not isinstance(whole, Mapping):
            return False
        return all((value is None and key not in whole) or (key in whole and contains(whole[key], value))
                   for key, value in part.items())
    return whole == part


def update_status(kube: Kube, namespace: str, name: str,
                  change: Callable[[dict], Mapping[str, Any] | None]) -> bool:
    """change(fresh object) → the status fields to merge in. Returns whether it wrote."""
    with _lock_for(namespace, name):
        obj = kube.get_llmdeployment(namespace, name)
        if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
            return False
        fields = change(obj)
        if not fields or contains(obj.get("status") or {}, fields):
            return False
        kube.patch_llmdeployment_status(namespace, name, fields)
        log.debug("%s/%s: status updated: %s", namespace, name, sorted(fields))
        return True
