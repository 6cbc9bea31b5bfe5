"""`spec.kvCache.offload`: the runtime's KV tiers under the block pool (quire/kv_tiers), and
the Valkey the operator runs for a shared tier when asked to.

    spec:
      kvCache:
        offload:
          hostSize: 8Gi                 # --kv-offloading-size (host RAM; counts against
                                        #   spec.resources.memory)
          disk:
            size: 50Gi                  # --kv-offloading-disk-size
            claimName: kv-cache         # a PVC mounted at /var/cache/quire-kv; without it an
                                        #   emptyDir of that size (lost with the pod)
          remote:                       # a Redis/Valkey every replica shares, one of:
            url: redis://valkey:6379    #   a URL,
            urlSecret: {name: kv, key: url}  # a Secret's key holding it,
            valkey:                     #   or a Valkey StatefulSet of the operator's own,
              memory: 4Gi               #   <name>-kv (maxmemory, allkeys-lru, no persistence)
              image: valkey/valkey:8.1

Pure functions: the flags, env, volumes and children; errors are SpecErrors naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names, pod_security, quantity
from .spec_error import SpecError

DISK_MOUNT = "/var/cache/quire-kv"
DISK_VOLUME = "kv-offload"
REMOTE_ENV = "QUIRE_KV_REMOTE_URL"
VALKEY_IMAGE = "valkey/valkey:8.1"
VALKEY_PORT = 6379
_URL = re.compile(r"^(redis|rediss|valkey|valkeys)://[^\s/?#]+(/[0-9]*)?$")
GIB = 2**30
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class ValkeySpec:
    memory: str = "1Gi"
    image: str = VALKEY_IMAGE


@dataclass(frozen=True)
class KVOffloadSpec:
    host_size: str | None = None
    disk_size: str | None = None
    disk_claim: str | None = None
    remote_url: str | None = None
    remote_secret: tuple[str, str] | None = None
    valkey: ValkeySpec | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.host_size or self.disk_size or self.remote_url or self.remote_secret
                    or self.valkey)


def parse_kv_cache_spec(raw_spec: Mapping[str, Any] | None) -> KVOffloadSpec:
    kv = (raw_spec or {}).get("kvCache")
    if kv is None:
        return KVOffloadSpec()
    path = "spec.kvCache"
    _object(kv, path)
    offload = kv.get("offload")
    if offload is None:
        return KVOffloadSpec()
    path += ".offload"
    _object(offload, path)
    host = _size(offload.get("hostSize"), f"{path}.hostSize")
    disk = offload.get("disk")
    disk_size = claim = None
    if disk is not None:
        _object(disk, f"{path}.disk")
        disk_size = _size(disk.get("size"), f"{path}.disk.size")
        if disk_size is None:
            raise SpecError(f"{path}.disk.size", "is required (the disk tier's byte budget)")
        claim = disk.get("claimName")
        if claim is not None and (not isinstance(claim, str) or not _CLAIM.match(claim)):
            raise SpecError(f"{path}.disk.claimName", f"{claim!r} is not a PersistentVolumeClaim name")
    url = secret = valkey = None
    remote = offload.get("remote")
    if remote is not None:
        rpath = f"{path}.remote"
        _object(remote, rpath)
        given = [k for k in ("url", "urlSecret", "valkey") if remote.get(k) is not None]
        if len(given) != 1:
            raise SpecError(rpath, "give exactly one of url, urlSecret and valkey")
        if remote.get("url") is not None:
            url = remote["url"]
            if not isinstance(url, str) or not _URL.match(url):
                raise SpecError(f"{rpath}.url", f"{url!r} must be a redis:// (rediss, valkey, "
                                                "valkeys) URL with a host")
        elif remote.get("urlSecret") is not None:
            ref = remote["urlSecret"]
            _object(ref, f"{rpath}.urlSecret")
            if not all(isinstance(ref.get(k), str) and ref.get(k) for k in ("name", "key")):
                raise SpecError(f"{rpath}.urlSecret", "needs a Secret's name and key")
            secret = (ref["name"], ref["key"])
        else:
            v = remote["valkey"]
            _object(v, f"{rpath}.valkey")
            memory = v.get("memory", "1Gi")
            if not quantity.is_quantity(memory) or quantity.value_of(memory) < 2**20:
                raise SpecError(f"{rpath}.valkey.memory", f"{memory!r} must be a quantity of at "
                                                          "least 1Mi")
            image = v.get("image", VALKEY_IMAGE)
            if not isinstance(image, str) or not image.strip():
                raise SpecError(f"{rpath}.valkey.image", "must be a non-empty string")
            valkey = ValkeySpec(str(memory), image)
    return KVOffloadSpec(host, disk_size, claim, url, secret, valkey)


def _object(value: Any, path: str) -> None:
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, not {type(value).__name__}")


def _size(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not quantity.is_quantity(value) or quantity.value_of(value) <= 0:
        raise SpecError(path, f"{value!r} must be a positive quantity such as 8Gi")
    return str(value)


def _gib(size: str) -> str:
    return f"{float(quantity.value_of(size)) / GIB:.6g}"


def valkey_name(name: str) -> str:
    return f"{name}-kv"


def kv_offload_args(name: str, spec: KVOffloadSpec) -> list[str]:
    """`quire serve` flags (vLLM's names)."""
    args = []
    if spec.host_size:
        args += ["--kv-offloading-backend", "native", "--kv-offloading-size", _gib(spec.host_size)]
    if spec.disk_size:
        args += ["--kv-offloading-disk-path", DISK_MOUNT,
                 "--kv-offloading-disk-size", _gib(spec.disk_size)]
    if spec.remote_url:
        args += ["--kv-offloading-remote", spec.remote_url]
    elif spec.remote_secret:  # the kubelet expands $(VAR) from the container's env
        args += ["--kv-offloading-remote", f"$({REMOTE_ENV})"]
    elif spec.valkey:
        args += ["--kv-offloading-remote", f"redis://{valkey_name(name)}:{VALKEY_PORT}/0"]
    return args


def kv_offload_env(spec: KVOffloadSpec) -> list[dict]:
    if not spec.remote_secret:
        return []
    secret, key = spec.remote_secret
    return [{"name": REMOTE_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]


def kv_offload_volumes(spec: KVOffloadSpec) -> tuple[list[dict], list[dict]]:
    if not spec.disk_size:
        return [], []
    source = ({"persistentVolumeClaim": {"claimName": spec.disk_claim}} if spec.disk_claim
              else {"emptyDir": {"sizeLimit": spec.disk_size}})
    return [{"name": DISK_VOLUME, **source}], [{"name": DISK_VOLUME, "mountPath": DISK_MOUNT}]


def valkey_child_names(name: str) -> list[tuple[str, str]]:
    return [("Service", valkey_name(name)), ("StatefulSet", valkey_name(name))]


def desired_valkey_children(owner: Mapping[str, Any], spec: KVOffloadSpec) -> list[dict]:
    """A Service and a one-pod StatefulSet running Valkey for the shared tier (none unless
    spec.kvCache.offload.remote.valkey asks). A cache, not a store: no persistence, and its
    own least-recently-used eviction within `memory`."""
    if spec.valkey is None:
        return []
    import kopf
    name = valkey_name(owner["metadata"]["name"])
    # not the runtime's selector labels: its Service must never pick this pod
    labels = {"app.kubernetes.io/name": "valkey", "app.kubernetes.io/instance": owner["metadata"]["name"],
              "app.kubernetes.io/component": "kv-cache", names.MANAGED_BY_LABEL: names.MANAGED_BY}
    maxmemory = int(quantity.value_of(spec.valkey.memory))
    container = {
        "name": "valkey",
        "image": spec.valkey.image,
        "args": ["--port", str(VALKEY_PORT), "--maxmemory", str(maxmemory),
                 "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no",
                 "--protected-mode", "no"],
        "ports": [{"name": "redis", "containerPort": VALKEY_PORT, "protocol": "TCP"}],
        # room beyond maxmemory for the server's own bookkeeping
        "resources": {"requests": {"memory": spec.valkey.memory},
                      "limits": {"memory": str(int(maxmemory * 1.25))}},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "securityContext": pod_security.container_security_context(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"type": "ClusterIP", "selector": labels,
                 "ports": [{"name": "redis", "port": VALKEY_PORT, "targetPort": "redis",
                            "protocol": "TCP"}]},
    }
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "serviceName": name, "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [container],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "securityContext": pod_security.pod_security_context(fs_group=False),
                "enableServiceLinks": False}},
        },
    }
    for obj in (service, statefulset):
        kopf.adopt(obj, owner=owner)
    return [service, statefulset]
