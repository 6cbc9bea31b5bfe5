"""spec.adapters and spec.lora: which LoRA adapters the replicas serve, and the runtime's LoRA limits.

An adapter's source is where the runtime pod reads it:
- an absolute path inside the pod (a volume the user mounts through the image or pod settings);
- `pvc://<claim>/<path>`: the operator mounts that PersistentVolumeClaim read-only at
  /adapters/<claim> in every runtime pod, and the runtime reads /adapters/<claim>/<path>.
`oci://` and `http(s)://` are the extension point for fetched adapters: refused today, by name.

LoRA is on (`--enable-lora --allow-runtime-lora`) when spec.lora is set or spec.adapters is not
empty. The adapter list itself never reaches the pod template: adapters are loaded and unloaded
through the runtime's API (adapter_sync.py), so editing the list restarts no pod. Only the set of
claims to mount does (a claim newly named, or no longer named by any adapter).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .names import CONTAINER_NAME
from .spec_error import SpecError

ADAPTERS_MOUNT = "/adapters"
PVC_SCHEME = "pvc://"
# Fetched sources: a documented extension point, refused until the runtime (or an init step) can fetch.
FETCHED_SCHEMES = ("oci://", "http://", "https://")
# Names clients send as `model`: DNS-like, so that they read well in URLs, labels and logs.
ADAPTER_NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$"
MAX_ADAPTER_NAME_LENGTH = 63
MAX_ADAPTERS = 256
MAX_SOURCE_LENGTH = 512  # the CRD's bound too (it keeps the cost of its CEL rule on every item low)
# A PersistentVolumeClaim's name is a DNS-1123 subdomain.
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SYNC_SECONDS_DEFAULT = 30
RUNTIME_LORA_FLAG = "--allow-runtime-lora"  # the runtime's load/unload endpoints exist only with it


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    source: str           # as written in the spec
    path: str             # where the runtime pod reads it
    claim: str | None = None  # the PersistentVolumeClaim to mount, for pvc:// sources


@dataclass(frozen=True)
class LoraSpec:
    """spec.lora; `enabled` also when only spec.adapters is set (then the runtime's default limits)."""
    enabled: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    sync_interval_seconds: int = SYNC_SECONDS_DEFAULT


def adapter_claims(adapters: Sequence[AdapterSpec]) -> list[str]:
    """The claims to mount, each once, in a stable order (the pod template must not churn)."""
    return sorted({a.claim for a in adapters if a.claim})


def claim_volume_name(claim: str) -> str:
    """A volume name (a DNS-1123 label) that depends only on the claim: adding another claim
    leaves the names of the ones already mounted alone."""
    return "adapters-" + hashlib.sha256(claim.encode()).hexdigest()[:12]


def lora_modules_in(args: Sequence[str]) -> set[str]:
    """Adapter names the user gives the runtime at start (`--lora-modules name=path ...` in
    spec.runtime.extraArgs): the user's, never loaded or unloaded by the operator."""
    found: set[str] = set()
    taking = False
    for arg in args:
        if arg.startswith("--lora-modules="):
            arg, taking = arg.split("=", 1)[1], True
        elif arg == "--lora-modules":
            taking = True
            continue
        elif arg.startswith("-"):
            taking = False
            continue
        if taking and "=" in arg:
            found.add(arg.split("=", 1)[0])
    return found


def parse_adapters(raw: Any, *, reserved: Mapping[str, str]) -> tuple[AdapterSpec, ...]:
    """spec.adapters; `reserved` maps names clients may not use for an adapter to why."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("spec.adapters", f"must be a list of {{name, source}} objects, not {type(raw).__name__}")
    if len(raw) > MAX_ADAPTERS:
        raise SpecError("spec.adapters", f"has {len(raw)} items; at most {MAX_ADAPTERS} are allowed")
    adapters: list[AdapterSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        path = f"spec.adapters[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(path, f"must be an object with name and source, not {type(item).__name__}")
        unknown = sorted(set(item) - {"name", "source"})
        if unknown:
            raise SpecError(f"{path}.{unknown[0]}", "is not a field of an adapter (allowed: name, source)")
        name = _name(item.get("name"), f"{path}.name")
        if name in seen:
            raise SpecError(f"{path}.name", f"{name!r} is already the name of spec.adapters[{seen[name]}]; "
                                            "adapter names must be unique")
        if name in reserved:
            raise SpecError(f"{path}.name", f"{name!r} is taken: {reserved[name]}")
        seen[name] = i
        adapters.append(_source(name, item.get("source"), f"{path}.source"))
    return tuple(adapters)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"is required: a non-empty string, not {value!r}")
    if len(value) > MAX_ADAPTER_NAME_LENGTH or not re.match(ADAPTER_NAME_PATTERN, value):
        raise SpecError(path, f"{value!r} is not a valid adapter name: at most {MAX_ADAPTER_NAME_LENGTH} "
                              "lower-case letters, digits, '-', '.' and '_', starting and ending with a "
                              "letter or digit")
    return value


def _source(name: str, value: Any, path: str) -> AdapterSpec:
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"is required: a non-empty string, not {value!r}")
    if len(value) > MAX_SOURCE_LENGTH:
        raise SpecError(path, f"is {len(value)} characters; at most {MAX_SOURCE_LENGTH} are allowed")
    allowed = "an absolute path inside the pod (on a volume you mount) or pvc://<claim>/<path>"
    lowered = value.lower()
    for scheme in FETCHED_SCHEMES:
        if lowered.startswith(scheme):
            raise SpecError(path, f"{value!r}: {scheme} sources are not supported yet; use {allowed}")
    if lowered.startswith(PVC_SCHEME):
        claim, _, inner = value[len(PVC_SCHEME):].partition("/")
        if not _CLAIM.match(claim) or len(claim) > 253:
            raise SpecError(path, f"{value!r} does not name a PersistentVolumeClaim: expected "
                                  "pvc://<claim>/<path>, the claim a DNS-1123 name")
        _check_relative(inner, value, path)
        return AdapterSpec(name, value, f"{ADAPTERS_MOUNT}/{claim}/{inner.strip('/')}", claim)
    if "://" in value:
        raise SpecError(path, f"{value!r}: unknown scheme; use {allowed}")
    if not value.startswith("/"):
        raise SpecError(path, f"{value!r} is not absolute; use {allowed}")
    if ".." in value.split("/"):
        raise SpecError(path, f"{value!r} must not contain '..'")
    return AdapterSpec(name, value, value)


def _check_relative(inner: str, value: str, path: str) -> None:
    parts = [p for p in inner.split("/") if p]
    if not parts:
        raise SpecError(path, f"{value!r} names no folder inside the claim: expected pvc://<claim>/<path>")
    if ".." in parts:
        raise SpecError(path, f"{value!r} must not contain '..'")


def parse_lora(raw: Any, adapters: Sequence[AdapterSpec]) -> LoraSpec:
    if raw is None:
        return LoraSpec(enabled=bool(adapters))
    if not isinstance(raw, Mapping):
        raise SpecError("spec.lora", f"must be an object, not {type(raw).__name__}")

    def integer(key: str, default: int | None, minimum: int, maximum: int) -> int | None:
        value = raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"spec.lora.{key}", f"must be an integer, not {value!r}")
        if not minimum <= value <= maximum:
            raise SpecError(f"spec.lora.{key}", f"{value} is outside {minimum}..{maximum}")
        return value

    unknown = sorted(set(raw) - {"maxLoras", "maxLoraRank", "maxCpuLoras", "syncIntervalSeconds"})
    if unknown:
        raise SpecError(f"spec.lora.{unknown[0]}", "is not a field of spec.lora (allowed: maxLoras, "
                                                   "maxLoraRank, maxCpuLoras, syncIntervalSeconds)")
    parsed = LoraSpec(
        enabled=True,
        max_loras=integer("maxLoras", None, 1, 256),
        max_lora_rank=integer("maxLoraRank", None, 1, 1024),
        max_cpu_loras=integer("maxCpuLoras", None, 1, 4096),
        sync_interval_seconds=integer("syncIntervalSeconds", SYNC_SECONDS_DEFAULT, 1, 3600),
    )
    if parsed.max_loras and parsed.max_cpu_loras and parsed.max_cpu_loras < parsed.max_loras:
        raise SpecError("spec.lora.maxCpuLoras", f"{parsed.max_cpu_loras} is below maxLoras {parsed.max_loras} "
                                                 "(the host cache holds at least the device slots)")
    return parsed


def runtime_lora(pod_spec: Mapping[str, Any]) -> bool:
    """Whether a pod's runtime takes adapters through its API: while a rollout turns LoRA on,
    the old pods do not, and the adapter sync leaves them out rather than fail on each."""
    return any(c.get("name") == CONTAINER_NAME and RUNTIME_LORA_FLAG in (c.get("args") or [])
               for c in pod_spec.get("containers") or [])


def lora_flags(lora: LoraSpec) -> list[str]:
    """The runtime's flags (vLLM's names); none when LoRA is off, so such pods keep their args."""
    if not lora.enabled:
        return []
    flags = ["--enable-lora", RUNTIME_LORA_FLAG]
    for flag, value in (("--max-loras", lora.max_loras), ("--max-lora-rank", lora.max_lora_rank),
                        ("--max-cpu-loras", lora.max_cpu_loras)):
        if value is not None:
            flags += [flag, str(value)]
    return flags
