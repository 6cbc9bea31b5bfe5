"""Has someone changed a child since the operator wrote it? A pure comparison of live and desired.

The live object holds everything the operator wrote plus what the API server and other
controllers added (defaults, clusterIP, revision annotations). So the question is whether the
live object still *contains* the desired one: every field the operator sets has the value it
set. Fields the operator never sets are left to whoever sets them (a mutating webhook, say).
Lists must match element for element (a removed probe, an added container), and quantities
compare by value, because the API server rewrites "0.5" as "500m" and 1 as "1".
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from . import names
from .quantity import same_quantity

# Maps the operator owns whole, where an extra key changes the meaning: a Service's selector
# (the main Service's moves between the runtime and the router pods; a merge patch alone would
# keep the old key, and a selector with both selects nothing), and the Services' and the
# InferencePool's, which select leaders only while the replicas are multi-node (a leftover
# worker-index key would select nothing once they are single-node pods again).
OWNED_MAPS = {"Service": (("spec", "selector"),),
              "InferencePool": (("spec", "selector", "matchLabels"),)}


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _extra_keys(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[tuple[str, ...], list[str]]:
    """Per owned map: the keys the live object has and the desired one does not."""
    extra = {}
    for path in OWNED_MAPS.get(desired.get("kind", ""), ()):
        have, want = _at(live, path), _at(desired, path)
        if isinstance(have, Mapping) and isinstance(want, Mapping) and set(have) - set(want):
            extra[path] = sorted(set(have) - set(want))
    return extra


def patch_for(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict:
    """The merge patch that makes `live` as desired: `desired`, plus null for the keys of owned
    maps that it does not set."""
    patch = copy.deepcopy(dict(desired))
    for path, keys in _extra_keys(live, desired).items():
        _at(patch, path).update({key: None for key in keys})
    return patch


def covers(live: Any, desired: Any) -> bool:
    """Whether merge-patching `live` with `desired` would change nothing that matters."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(key in live and covers(live[key], value)
                                                 for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(covers(have, want) for have, want in zip(live, desired)))
    return live == desired or (isinstance(live, (str, int)) and isinstance(desired, (str, int))
                               and same_quantity(live, desired))


def drift_of(live: Mapping[str, Any], desired: Mapping[str, Any]) -> str | None:
    """None if the live child is as desired; otherwise which of its parts differ, for the log."""
    extra = _extra_keys(live, desired)
    if covers(live, desired) and not extra:
        return None
    parts = [".".join(path) for path in extra]
    for section in ("metadata", "spec"):
        have, want = live.get(section) or {}, desired.get(section) or {}
        for key, value in want.items():
            if key == "annotations" and names.HASH_ANNOTATION in value:
                value = {k: v for k, v in value.items() if k != names.HASH_ANNOTATION}
            if not covers(have.get(key), value) and f"{section}.{key}" not in parts:
                parts.append(f"{section}.{key}")
    return ", ".join(parts) or "its content"
