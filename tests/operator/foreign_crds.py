"""Other projects' CRDs (vendored_crds/: GIE's InferencePool, Gateway API's HTTPRoute, KEDA's
ScaledObject, LWS's LeaderWorkerSet) and the API server's validation of their objects, for the pure tests and the
emulator alike.

`problems(obj)` is what the API server would say: schema errors (structural defaults first, as
the server applies them), broken CEL rules, and fields that the structural schema would prune
(a pruned field would come back missing, and the operator would "repair" it forever).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import crd_rules  # tests/charts is on the test path
import yaml

FOLDER = pathlib.Path(__file__).resolve().parent / "vendored_crds"
CRDS = {crd["spec"]["names"]["kind"]: crd
        for crd in (yaml.safe_load(path.read_text()) for path in sorted(FOLDER.glob("*.yaml")))}


def api_version(kind: str) -> str:
    crd = CRDS[kind]
    (version,) = [v["name"] for v in crd["spec"]["versions"] if v["storage"]]
    return f"{crd['spec']['group']}/{version}"


def plural(kind: str) -> str:
    return CRDS[kind]["spec"]["names"]["plural"]


def pruned(obj: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """The paths of fields the structural schema does not know (the API server drops them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, Mapping):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            here = f"{path}.{key}" if path else key
            if props is not None and key in props:
                found += pruned(value, props[key], here)
            elif isinstance(extra, Mapping):
                found += pruned(value, extra, here)
            elif props is not None and path != "metadata":
                found.append(here)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            found += pruned(item, schema["items"], f"{path}[{i}]")
    return found


def problems(obj: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse (or silently change) this object; [] when it is fine."""
    kind = obj.get("kind")
    if kind not in CRDS:
        return [f"no vendored CRD for kind {kind!r}"]
    if obj.get("apiVersion") != api_version(kind):
        return [f"apiVersion {obj.get('apiVersion')!r}: the CRD serves {api_version(kind)}"]
    schema = crd_rules.schema_of(CRDS[kind])
    content = {key: obj[key] for key in ("apiVersion", "kind", "spec") if key in obj}
    found = [f"{path}: unknown field (the API server would prune it)"
             for path in pruned(content, schema)]
    return found + crd_rules.violations(dict(content, metadata={}), CRDS[kind])


def install(emulator: Any) -> None:
    """Register the vendored kinds in the emulated API server, refusing invalid objects with 422."""
    for kind, crd in CRDS.items():
        emulator.register_crd(crd)
        emulator.add_validation(plural(kind), lambda obj: "; ".join(problems(obj)) or None)
