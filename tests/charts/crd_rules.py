"""The CRD's validation as the API server applies it, for the tests: the OpenAPI schema with
structural defaults (jsonschema, draft 4 as Kubernetes' OpenAPI v3.0), then every
x-kubernetes-validations CEL rule at its node (cel-python: the emulator and jsonschema run no CEL)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema


def schema_of(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(obj: Any, schema: dict) -> Any:
    """Defaults fill absent fields of objects that exist, before any rule runs."""
    if isinstance(obj, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key not in obj and "default" in prop:
                obj[key] = copy.deepcopy(prop["default"])
            if key in obj:
                apply_defaults(obj[key], prop)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])
    return obj


def rules(schema: dict, path: str = "") -> Iterator[tuple[str, dict, dict]]:
    """(path, rule, the node's schema) for every CEL rule in the schema."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path or ".", rule, schema
    for key, prop in (schema.get("properties") or {}).items():
        yield from rules(prop, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from rules(schema["items"], f"{path}[]")


def compile_rule(text: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(text))


def cel_violations(obj: Any, schema: dict) -> list[str]:
    """The messages of the rules that `obj` breaks, walking the object alongside its schema."""
    broken = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if not compile_rule(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)}):
            broken.append(rule.get("message", rule["rule"]))
    if isinstance(obj, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key in obj:
                broken += cel_violations(obj[key], prop)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            broken += cel_violations(item, schema["items"])
    return broken


def violations(resource: dict, crd: dict) -> list[str]:
    """Why the API server would refuse this resource: schema errors first, then CEL rules."""
    schema = schema_of(crd)
    obj = apply_defaults(copy.deepcopy(resource), schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]
    return errors or cel_violations(obj, schema)
