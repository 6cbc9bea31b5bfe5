"""One adapter sync: make every ready replica serve the adapters of spec.adapters, and say so.

For each ready runtime pod: read /v1/models, unload what the operator manages but the spec no
longer names (or names with another source), load what is missing. Replicas are synced in
parallel and independently: one that refuses or does not answer is reported (a Warning Event
naming the adapter, the pod and the runtime's message; the adapter's status row) and tried
again at the next sync, while the others go on.

Which adapters the operator manages: the names in spec.adapters, plus the names it loaded
before that the spec dropped, until no replica has them (status.managedAdapters keeps that list
across operator restarts). Anything else a replica serves is left alone: adapters given at start
with `--lora-modules` in spec.runtime.extraArgs (spec.py refuses spec.adapters names that clash
with them) and adapters someone loaded by hand through the API.

Status, per adapter of the spec: {name, source, readyReplicas, replicas, ready: "2/2", message?};
`adaptersReady`: how many adapters every ready replica serves, out of how many the spec names.
"""

from __future__ import annotations

import base64
import logging
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .adapter_client import AdapterApiError, RuntimeAdapters
from .adapter_spec import AdapterSpec
from .kube import ApiError, Kube
from .pod_tls import TLSTrustError, client_context
from .scaling import PodRef
from .scrape import MAX_PARALLEL_SCRAPES
from .spec import LLMSpec
from .status_writer import update_status

log = logging.getLogger(__name__)

# announce(type, reason, message): an Event on the LLMDeployment.
Announce = Callable[[str, str, str], None]
ALREADY_LOADED = "has already been loaded"


@dataclass(frozen=True)
class ReplicaPlan:
    unload: tuple[str, ...]
    load: tuple[AdapterSpec, ...]


def _same_path(a: str, b: str) -> bool:
    return posixpath.normpath(a) == posixpath.normpath(b)


def plan_replica(desired: Sequence[AdapterSpec], managed: Iterable[str], present: Mapping[str, str]) -> ReplicaPlan:
    """What one replica must unload and load (pure). `present`: name → the path it was loaded from."""
    wanted = {a.name: a for a in desired}
    managed = set(managed)
    unload = tuple(sorted(n for n, root in present.items()
                          if (n not in wanted and n in managed)
                          or (n in wanted and root and not _same_path(root, wanted[n].path))))
    load = tuple(a for a in desired if a.name not in present or a.name in unload)
    return ReplicaPlan(unload, load)


@dataclass
class ReplicaOutcome:
    pod: str
    present: dict[str, str] | None  # what it serves after the sync; None: it did not answer
    error: str | None = None        # why it did not answer
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # adapter → the runtime's message


def sync_replica(client: RuntimeAdapters, pod: str, desired: Sequence[AdapterSpec], managed: Iterable[str]) -> ReplicaOutcome:
    try:
        present = client.loaded()
    except AdapterApiError as e:
        return ReplicaOutcome(pod, None, error=str(e))
    outcome = ReplicaOutcome(pod, present)
    todo = plan_replica(desired, managed, present)
    for name in todo.unload:
        try:
            client.unload(name)
        except AdapterApiError as e:
            if e.status != 404:  # 404: gone already, which is what was wanted
                outcome.failures[name] = f"unload failed: {e}"
                continue
        present.pop(name, None)
        outcome.unloaded.append(name)
    for adapter in todo.load:
        if adapter.name in present:
            continue  # its old version would not unload: reported above
        try:
            client.load(adapter.name, adapter.path)
        except AdapterApiError as e:
            if not (e.status == 400 and ALREADY_LOADED in e.message):  # a race with another loader
                outcome.failures[adapter.name] = str(e)
                continue
        present[adapter.name] = adapter.path
        outcome.loaded.append(adapter.name)
    return outcome


def read_api_key(kube: Kube, namespace: str, secret_key: tuple[str, str] | None) -> str | None:
    """The key of spec.runtime.apiKeySecret, which the pods require on every request; raises ApiError
    or KeyError (the Secret or its key is missing)."""
    if secret_key is None:
        return None
    secret_name, key = secret_key
    secret = kube.get("", "v1", "secrets", namespace, secret_name)
    if secret is None:
        raise KeyError(f"Secret {secret_name!r} does not exist")
    data = (secret.get("data") or {}).get(key)
    if data is None:
        raise KeyError(f"Secret {secret_name!r} has no key {key!r}")
    value = base64.b64decode(data).decode()
    if value != value.strip():
        # The runtime compares the key exactly, and no HTTP header can carry a newline.
        raise ValueError(f"the key {key!r} of Secret {secret_name!r} starts or ends with whitespace (a newline "
                         "from `echo`?): no client can send it; recreate it with --from-literal")
    return value


def adapter_rows(desired: Sequence[AdapterSpec], outcomes: Sequence[ReplicaOutcome]) -> list[dict]:
    rows = []
    for adapter in desired:
        ready = sum(1 for o in outcomes if o.present is not None and adapter.name in o.present)
        problems = [f"{o.pod}: {o.failures[adapter.name]}" for o in outcomes if adapter.name in o.failures]
        problems += [f"{o.pod}: {o.error}" for o in outcomes if o.present is None]
        row = {"name": adapter.name, "source": adapter.source, "readyReplicas": ready,
               "replicas": len(outcomes), "ready": f"{ready}/{len(outcomes)}"}
        if problems:
            row["message"] = "; ".join(problems)[:1024]
        rows.append(row)
    return rows


def summary(rows: Sequence[Mapping]) -> str:
    """'2/3': two of the spec's three adapters are served by every ready replica (and one runs)."""
    everywhere = sum(1 for r in rows if r["replicas"] and r["readyReplicas"] == r["replicas"])
    return f"{everywhere}/{len(rows)}"


def still_managed(desired: Sequence[AdapterSpec], managed: Iterable[str], outcomes: Sequence[ReplicaOutcome],
                  pods_left_out: bool = False) -> list[str]:
    """The spec's names, and dropped ones a replica may still serve: it has it, it did not answer,
    or a pod was not asked at all (not ready now: it may be again, adapters and all)."""
    names = {a.name for a in desired}
    dropped = {n for n in managed if n not in names
               and (pods_left_out or any(o.present is None or n in o.present for o in outcomes))}
    return sorted(names | dropped)


def sync_adapters(kube: Kube, namespace: str, name: str, spec: LLMSpec, pods: Iterable[PodRef],
                  announced: frozenset | None, announce: Announce) -> frozenset:
    """One sync of every ready replica. `announced`: the problems already told in a Warning (each
    is told once, until it clears); returns the set for the next sync."""
    announced = announced or frozenset()
    obj = kube.get_llmdeployment(namespace, name)
    if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
        return announced
    managed = (obj.get("status") or {}).get("managedAdapters") or []
    try:
        tls = client_context(kube, namespace, spec.tls)
    except (ApiError, TLSTrustError) as e:
        return _cannot_ask(namespace, name, "cannot verify the replicas' HTTPS certificates (spec.tls), so no "
                                            f"replica can be asked to load adapters: {e}", announced, announce)
    try:
        api_key = read_api_key(kube, namespace, spec.runtime.api_key_secret)
    except (ApiError, KeyError, ValueError) as e:
        return _cannot_ask(namespace, name, "cannot read the API key of spec.runtime.apiKeySecret, so no replica "
                                            f"can be asked to load adapters: {e}", announced, announce)

    # Pods not started with --allow-runtime-lora (the old ones, while LoRA's rollout runs) are
    # no replicas of an adapter: they go away.
    pods = list(pods)
    ready = [p for p in pods if p.ready and p.ip and p.runtime_lora]
    desired = spec.adapters

    def one(pod: PodRef) -> ReplicaOutcome:
        return sync_replica(RuntimeAdapters(pod.ip, spec.port, api_key, tls), pod.name, desired, managed)

    outcomes: list[ReplicaOutcome] = []
    if ready:
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(ready))) as pool:
            outcomes = list(pool.map(one, ready))
    rows = adapter_rows(desired, outcomes)
    left_out = any(p.runtime_lora and p not in ready for p in pods)
    fields = {"adapters": rows, "adaptersReady": summary(rows),
              "managedAdapters": still_managed(desired, managed, outcomes, left_out)}
    update_status(kube, namespace, name, lambda _: fields)
    return _announce(outcomes, rows, spec.lora.sync_interval_seconds, announced, announce)


def _cannot_ask(namespace: str, name: str, message: str, announced: frozenset, announce: Announce) -> frozenset:
    """No replica can be called: said once in a Warning (until it clears), logged every time."""
    problem = ("AdapterSyncFailed", message)
    if problem not in announced:
        announce("Warning", *problem)
    log.warning("%s/%s: %s", namespace, name, message)
    return frozenset({problem})


def _announce(outcomes: Sequence[ReplicaOutcome], rows: Sequence[Mapping], interval: int,
              announced: frozenset, announce: Announce) -> frozenset:
    by_name = {r["name"]: r for r in rows}
    for adapter in sorted({n for o in outcomes for n in o.loaded}):
        pods = ", ".join(o.pod for o in outcomes if adapter in o.loaded)
        row = by_name.get(adapter)
        said = f"; ready on {row['ready']} replicas" if row else ""
        announce("Normal", "AdapterLoaded", f"adapter {adapter} loaded on {pods}{said}")
    for adapter in sorted({n for o in outcomes for n in o.unloaded}):
        pods = ", ".join(o.pod for o in outcomes if adapter in o.unloaded)
        reason = "no longer in spec.adapters" if adapter not in by_name else "its source changed"
        announce("Normal", "AdapterUnloaded", f"adapter {adapter} unloaded from {pods} ({reason})")
    current = set()
    for o in outcomes:
        if o.present is None:
            current.add(("AdapterSyncFailed", f"pod {o.pod} did not list its adapters: {o.error}; "
                                              f"retrying every {interval}s"))
        for adapter, message in sorted(o.failures.items()):
            reason = "AdapterUnloadFailed" if message.startswith("unload failed") else "AdapterLoadFailed"
            current.add((reason, f"adapter {adapter} failed on pod {o.pod}: {message}; retrying every {interval}s"))
    for problem in sorted(current - announced):
        log.warning("%s", problem[1])
        announce("Warning", *problem)
    return frozenset(current)
