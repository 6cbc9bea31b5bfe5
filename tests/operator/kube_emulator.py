"""A Kubernetes API server for the operator tests: kmock's emulator with the gaps closed.

kmock 0.8 keeps objects and serves discovery over real HTTP, but as a bare store. This subclass
serves every request for a registered resource itself, the way the API server does:

- uid, resourceVersion (one counter), generation (bumped on spec changes), creationTimestamp,
  generateName; POST answers 201; a name that exists answers 409;
- merge-patch and JSON-patch (a failed `test` answers 422, as kopf expects); strategic merge
  is taken as a merge patch, which is enough for the fields the tests touch;
- status and spec writes kept apart for resources with a status subresource; /scale
  read and written through the CRD's scale paths; a write that changes nothing changes no
  resourceVersion and sends no watch event;
- watches that honour resourceVersion (a replay from the event log), label and field
  selectors and timeoutSeconds; lists with label selectors;
- deletion with finalizers (deletionTimestamp first) and garbage collection of dependents
  through ownerReferences;
- validation rules a test adds (`add_validation`), standing in for the API server's own
  validation of built-in kinds: a create or update that breaks one answers 422 Invalid.

It has no controllers: a Deployment gets no status and no pods unless the test makes them.
It validates no schemas. `RunningEmulator` runs it in a thread of its own with its own loop,
so tests stay synchronous and talk to it over HTTP like kubectl would.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import string
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import apps


@dataclass
class ResourceType:
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    scale_paths: tuple[str, str, str] | None = None  # spec replicas, status replicas, selector


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _get_path(obj: dict, path: str) -> Any:
    for key in path.strip(".").split("."):
        obj = (obj or {}).get(key) if isinstance(obj, dict) else None
    return obj


def _set_path(obj: dict, path: str, value: Any) -> None:
    keys = path.strip(".").split(".")
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    obj[keys[-1]] = value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?(?P<key>[\w./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<val>[\w./-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<vals>[^)]*)\))?\s*$")


def label_selector(text: str | None) -> Callable[[dict], bool]:
    """The label-selector grammar of the API server: =, ==, !=, in, notin, key, !key."""
    if not text:
        return lambda labels: True
    terms = []
    for raw in re.split(r",(?![^()]*\))", text):
        m = _SELECTOR_TERM.match(raw)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {raw!r}")
        terms.append(m.groupdict())

    def matches(labels: dict) -> bool:
        for t in terms:
            key, have = t["key"], labels.get(t["key"])
            if t["op"] in ("=", "=="):
                ok = have == t["val"]
            elif t["op"] == "!=":
                ok = have != t["val"]
            elif t["setop"]:
                values = {v.strip() for v in t["vals"].split(",")}
                ok = (have in values) if t["setop"] == "in" else (have not in values)
            else:
                ok = (key not in labels) if t["neg"] else (key in labels)
            if not ok:
                return False
        return True

    return matches


def field_selector(text: str | None) -> Callable[[dict], bool]:
    if not text:
        return lambda obj: True
    terms = []
    for raw in text.split(","):
        m = re.match(r"^\s*(metadata\.name|metadata\.namespace)\s*(==|=|!=)\s*(.*?)\s*$", raw)
        if not m:
            raise ApiError(400, "BadRequest", f"field selector not supported here: {raw!r}")
        terms.append(m.groups())
    return lambda obj: all((_get_path(obj, path) == value) == (op != "!=") for path, op, value in terms)


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    _types: dict = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: list = attrs.field(factory=list, init=False)  # (rv, resource, event type, object)
    _tick: Any = attrs.field(default=None, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _validations: list = attrs.field(factory=list, init=False)  # (plural, check(obj) → message or None, code)

    # --- registration ---

    def register(self, group: str, version: str, plural: str, rtype: ResourceType,
                 shortnames: tuple[str, ...] = ()) -> None:
        res = kmock.resource(group, version, plural)
        self._types[res] = rtype
        subresources = set()
        if rtype.status_subresource:
            subresources.add("status")
        if rtype.scale_paths:
            subresources.add("scale")
        self.resources[res] = kmock.ResourceInfo(
            kind=rtype.kind, singular=rtype.kind.lower(), namespaced=rtype.namespaced, shortnames=set(shortnames),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources=subresources)

    def add_validation(self, plural: str, check: Callable[[dict], str | None], code: int = 422) -> None:
        """check(object as it would be stored) → why it is invalid, or None. Another `code`
        (500, say) makes it an outage of the API server for such objects instead."""
        self._validations.append((plural, check, code))

    def clear_validations(self) -> None:
        self._validations.clear()

    def _validate(self, res: Any, obj: dict) -> None:
        for plural, check, code in self._validations:
            if res.plural == plural and (message := check(obj)):
                if code != 422:
                    raise ApiError(code, "InternalError", message)
                raise ApiError(422, "Invalid", f'{self._type_of(res).kind} "{obj["metadata"].get("name")}" '
                                               f"is invalid: {message}")

    def register_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            subs = version.get("subresources") or {}
            scale = subs.get("scale")
            self.register(spec["group"], version["name"], spec["names"]["plural"], ResourceType(
                kind=spec["names"]["kind"], namespaced=spec["scope"] == "Namespaced",
                status_subresource="status" in subs,
                scale_paths=(scale["specReplicasPath"], scale["statusReplicasPath"],
                             scale.get("labelSelectorPath", "")) if scale else None,
            ), shortnames=tuple(spec["names"].get("shortNames", [])))

    def register_builtins(self) -> None:
        # kopf waits to discover namespaces even when it watches cluster-wide and never lists them.
        self.register("", "v1", "namespaces", ResourceType("Namespace", namespaced=False, status_subresource=True))
        self.register("", "v1", "pods", ResourceType("Pod", status_subresource=True))
        self.register("", "v1", "services", ResourceType("Service", status_subresource=True))
        self.register("", "v1", "events", ResourceType("Event"))
        self.register("", "v1", "secrets", ResourceType("Secret"))  # spec.runtime.apiKeySecret, spec.tls
        self.register("apps", "v1", "deployments", ResourceType(
            "Deployment", status_subresource=True,
            scale_paths=(".spec.replicas", ".status.replicas", "")))
        self.register("policy", "v1", "poddisruptionbudgets", ResourceType(
            "PodDisruptionBudget", status_subresource=True))
        self.register("coordination.k8s.io", "v1", "leases", ResourceType("Lease"))
        self.register("networking.k8s.io", "v1", "networkpolicies", ResourceType("NetworkPolicy"))
        # spec.router's children, and what its router watches
        self.register("", "v1", "serviceaccounts", ResourceType("ServiceAccount"))
        self.register("rbac.authorization.k8s.io", "v1", "roles", ResourceType("Role"))
        self.register("rbac.authorization.k8s.io", "v1", "rolebindings", ResourceType("RoleBinding"))
        self.register("discovery.k8s.io", "v1", "endpointslices", ResourceType("EndpointSlice"))
        self.register("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                      ResourceType("CustomResourceDefinition", namespaced=False, status_subresource=True))

    # --- request dispatch ---

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or self._type_of(res) is None:
            return await apps.RawHandler._handle(self, request)  # discovery and the rest: kmock's
        try:
            return await self._serve(request, self._type_of(res))
        except ApiError as e:
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": e.code, "reason": e.reason, "message": e.message,
            }, status=e.code)

    def _type_of(self, res: Any) -> ResourceType | None:
        for known, rtype in self._types.items():
            if known == res:
                return rtype
        return None

    async def _serve(self, request: kmock.Request, rtype: ResourceType) -> aiohttp.web.StreamResponse:
        method, name, sub = request.method.value, request.name, request.subresource
        if self._tick is None:
            self._tick = asyncio.Event()
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request)
        if method == "GET" and name is None:
            return aiohttp.web.json_response(self._list(request, rtype))
        if method == "GET":
            obj = self._existing(request)
            return aiohttp.web.json_response(self._scale_of(obj, rtype) if sub == "scale" else obj)
        if method == "POST" and name is None:
            return aiohttp.web.json_response(self._create(request, rtype), status=201)
        if method in ("PATCH", "PUT") and name is not None:
            return aiohttp.web.json_response(self._update(request, rtype))
        if method == "DELETE" and name is not None:
            return aiohttp.web.json_response(self._delete(request.resource, request.namespace, name))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    # --- reads ---

    def _key(self, res: Any, namespace: str | None, name: str) -> tuple:
        return (kmock.resource(res.group, res.version, res.plural), namespace, name)

    def _existing(self, request: kmock.Request) -> dict:
        key = self._key(request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        return copy.deepcopy(self.objects[key].raw)

    def _live(self, res: Any, namespace: str | None = None) -> list[dict]:
        return [copy.deepcopy(obj.raw) for (r, ns, _), obj in list(self.objects.items())
                if r == res and not obj.deleted and (namespace is None or ns == namespace)]

    def _list(self, request: kmock.Request, rtype: ResourceType) -> dict:
        labels = label_selector(request.params.get("labelSelector"))
        fields = field_selector(request.params.get("fieldSelector"))
        items = [o for o in self._live(request.resource, request.namespace)
                 if labels(o.get("metadata", {}).get("labels") or {}) and fields(o)]
        res = request.resource
        return {"apiVersion": f"{res.group}/{res.version}" if res.group else res.version,
                "kind": f"{rtype.kind}List", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _scale_of(self, obj: dict, rtype: ResourceType) -> dict:
        if rtype.scale_paths is None:
            raise ApiError(404, "NotFound", "the resource has no scale subresource")
        spec_path, status_path, selector_path = rtype.scale_paths
        meta = obj["metadata"]
        status = {"replicas": _get_path(obj, status_path) or 0}
        if selector_path and _get_path(obj, selector_path):
            status["selector"] = _get_path(obj, selector_path)
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": _get_path(obj, spec_path) or 0}, "status": status}

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        labels = label_selector(request.params.get("labelSelector"))
        fields = field_selector(request.params.get("fieldSelector"))
        res, namespace = request.resource, request.namespace
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        since = request.params.get("resourceVersion")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def wanted(obj: dict) -> bool:
            meta = obj.get("metadata", {})
            return ((namespace is None or meta.get("namespace") == namespace)
                    and labels(meta.get("labels") or {}) and fields(obj))

        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        if since in (None, "", "0"):
            backlog = [{"type": "ADDED", "object": o} for o in self._live(res, namespace) if wanted(o)]
            position = len(self._log)
        else:
            backlog = []
            position = next((i for i, (rv, *_) in enumerate(self._log) if rv > int(since)), len(self._log))
        try:
            for event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            while not self._closing:
                while position < len(self._log):
                    _, r, kind, obj = self._log[position]
                    position += 1
                    if r == res and wanted(obj):
                        await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._tick.wait(), timeout=min(remaining, 0.5))
                except asyncio.TimeoutError:
                    pass
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response

    # --- writes ---

    def _emit(self, res: Any, kind: str, obj: dict) -> None:
        self._log.append((self._rv, kmock.resource(res.group, res.version, res.plural), kind, copy.deepcopy(obj)))
        self._tick.set()
        self._tick = asyncio.Event()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _create(self, request: kmock.Request, rtype: ResourceType) -> dict:
        body = request.data
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        namespace = request.namespace if rtype.namespaced else None
        if rtype.namespaced and meta.get("namespace") not in (None, namespace):
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if not name:
            raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
        key = self._key(request.resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise ApiError(409, "AlreadyExists", f'{request.resource.plural} "{name}" already exists')
        res = request.resource
        obj.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        obj.setdefault("kind", rtype.kind)
        meta.update(name=name, uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now(),
                    resourceVersion=self._next_rv())
        if namespace:
            meta["namespace"] = namespace
        for key_ in ("deletionTimestamp", "generateName"):
            meta.pop(key_, None)
        if rtype.status_subresource:
            obj.pop("status", None)  # the API server ignores status on create
        self._validate(res, obj)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._emit(res, "ADDED", obj)
        self._collect_if_orphaned(res, namespace, name, obj)
        return obj

    def _patched(self, target: dict, request: kmock.Request) -> dict:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = request.data
        if request.method.value == "PUT":
            return copy.deepcopy(body)
        if content_type == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(target, body, in_place=False)
            except jsonpatch.JsonPatchTestFailed as e:
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {e}")
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise ApiError(422, "Invalid", str(e))
        if content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
            return merge_patch(target, body)
        raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type: {content_type!r}")

    def _update(self, request: kmock.Request, rtype: ResourceType) -> dict:
        old = self._existing(request)
        sub = request.subresource
        if sub == "scale":
            spec_path = rtype.scale_paths[0] if rtype.scale_paths else None
            scale = self._patched(self._scale_of(old, rtype), request)
            new = copy.deepcopy(old)
            _set_path(new, spec_path, scale.get("spec", {}).get("replicas", 0))
        elif sub == "status":
            new = copy.deepcopy(old)
            new["status"] = self._patched(old, request).get("status")
            if new["status"] is None:
                new.pop("status")
        elif sub is None:
            new = self._patched(old, request)
            if rtype.status_subresource:  # the main resource ignores status writes
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
        else:
            raise ApiError(404, "NotFound", f"no subresource {sub!r}")

        asked_rv = (new.get("metadata") or {}).get("resourceVersion")
        if asked_rv not in (None, old["metadata"]["resourceVersion"]) and sub != "scale":
            raise ApiError(409, "Conflict", "the object has been modified; please apply your changes "
                                            "to the latest version and try again")
        meta = new.setdefault("metadata", {})
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
        if old.get("metadata", {}).get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        if new == old:
            return self._scale_of(old, rtype) if sub == "scale" else old  # a no-op writes nothing
        self._validate(request.resource, new)

        spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if spec_of(new) != spec_of(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        key = self._key(request.resource, request.namespace, request.name)
        self.objects[key].history.append(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(request.resource, request.namespace, request.name)
        else:
            self._emit(request.resource, "MODIFIED", new)
        return self._scale_of(new, rtype) if sub == "scale" else new

    def _delete(self, res: Any, namespace: str | None, name: str) -> dict:
        key = self._key(res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        obj = copy.deepcopy(self.objects[key].raw)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[key].history.append(obj)
                self._emit(res, "MODIFIED", obj)
            return obj
        return self._remove(res, namespace, name)

    def _remove(self, res: Any, namespace: str | None, name: str) -> dict:
        key = self._key(res, namespace, name)
        obj = copy.deepcopy(self.objects[key].raw)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[key].delete()
        self._emit(res, "DELETED", obj)
        self._collect_garbage(obj["metadata"]["uid"])
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: dependents of a deleted owner go too."""
        for (res, namespace, name), stored in list(self.objects.items()):
            if stored.deleted:
                continue
            refs = stored.raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                self._delete(res, namespace, name)

    def _collect_if_orphaned(self, res: Any, namespace: str | None, name: str, obj: dict) -> None:
        """An object created for an owner that is gone is collected too, as the garbage
        collector does (a controller may create a child just as its owner is deleted)."""
        refs = obj.get("metadata", {}).get("ownerReferences") or []
        if not refs:
            return
        live_uids = {stored.raw["metadata"].get("uid") for stored in self.objects.values() if not stored.deleted}
        if not any(ref.get("uid") in live_uids for ref in refs):
            self._delete(res, namespace, name)

    # --- for tests, on the emulator's own loop ---

    def close_watches(self) -> None:
        self._closing = True
        if self._tick is not None:
            self._tick.set()


class RunningEmulator:
    """The emulator in a thread of its own; `url` is its address, `call(fn)` runs fn on its loop."""

    def __init__(self, setup: Callable[[KubeEmulator], None]) -> None:
        self._setup = setup
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self.emulator: KubeEmulator | None = None
        self.url = ""
        self._error: BaseException | None = None

    def __enter__(self) -> RunningEmulator:
        self._thread.start()
        self._ready.wait(10)
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to the test in __enter__
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        emulator = KubeEmulator()
        self._setup(emulator)
        async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            self.emulator = emulator
            self.url = f"http://127.0.0.1:{server.port}"
            self._ready.set()
            await self._stop.wait()
            emulator.close_watches()
            await asyncio.sleep(0.6)  # let the watch streams see the flag and end

    def call(self, fn: Callable[[KubeEmulator], Any]) -> Any:
        """Run fn(emulator) on the emulator's loop: a consistent view of its state."""
        assert self._loop is not None and self.emulator is not None

        async def run() -> Any:
            return fn(self.emulator)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)
