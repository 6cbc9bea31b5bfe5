"""A request's priority and tenant, as flow control (flow_control.py) weighs them.

Priorities here are GIE's: higher is more important, 0 the default, below 0 sheddable. A
request's priority comes from, in order:

1. its InferenceObjective: the `x-gateway-inference-objective` header (GIE's) names one,
   whose `spec.priority` counts (`--objective NAME=PRIORITY`, or the InferenceObjectives of
   the router's namespace, watched: `--watch-objectives`). An unknown name counts in
   `quire_router:unknown_objectives_total` and falls through, never an error;
2. the body's `priority`, which is vLLM's (the engine's: lower is served first), so its
   negation: a body priority of 2 is a GIE priority of -2 (sheddable), -3 is 3;
3. 0.

A request whose priority came from its objective is forwarded with the engine's priority set
to match (the body's `priority` = minus the objective's), unless it gave its own, so the
replica's scheduler orders it as the router did. The tenant is the `--tenant-header` value
(GIE's fairness header by default), else the bearer key, else "anonymous".
"""

from __future__ import annotations

import json
import logging

from quire.priorities import MAX_PRIORITY, MIN_PRIORITY
from quire.router.discovery_k8s import EndpointSliceWatch

logger = logging.getLogger(__name__)

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"  # GIE's flow-control fairness id
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"


class BadPriority(ValueError):
    """The body's priority is not an integer in range: a 400 naming `priority`."""


class ObjectiveTable:
    """InferenceObjective name -> priority: the flags' entries over the watched ones."""

    def __init__(self, static: dict[str, int] | None = None) -> None:
        self.static = dict(static or {})
        self.watched: dict[str, int] = {}

    def get(self, name: str) -> int | None:
        return self.static.get(name, self.watched.get(name))

    def __contains__(self, name: str) -> bool:
        return name in self.static or name in self.watched


def parse_objective_flags(values: list[str]) -> dict[str, int]:
    """`--objective NAME=PRIORITY` values (ValueError naming the bad one)."""
    table = {}
    for value in values:
        name, sep, priority = value.partition("=")
        try:
            number = int(priority)
        except ValueError:
            number = None
        if not sep or not name or number is None or not MIN_PRIORITY <= number <= MAX_PRIORITY:
            raise ValueError(f"--objective must be NAME=PRIORITY with an integer priority, "
                             f"got {value!r}")
        table[name] = number
    return table


def body_priority(body) -> int | None:
    """The body's own (vLLM-scale) priority, None when absent; BadPriority when invalid."""
    if not isinstance(body, dict) or "priority" not in body:
        return None
    value = body["priority"]
    if isinstance(value, bool) or not isinstance(value, int) \
            or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise BadPriority(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] "
                          f"(lower is served first), got {json.dumps(value)}")
    return value


def request_priority(headers: dict[str, str], body, table: ObjectiveTable,
                     metrics) -> tuple[int, int | None]:
    """(GIE-scale priority, the engine priority to forward or None to leave the body as is).
    `headers`: lower-case names. Raises BadPriority."""
    own = body_priority(body)
    objective = headers.get(OBJECTIVE_HEADER)
    if objective:
        priority = table.get(objective)
        if priority is not None:
            # forwarded in a JSON object's body only (any other body is the replica's to
            # refuse, or has no priority: GET /v1/models)
            forward = None if own is not None or not isinstance(body, dict) \
                else _clamp(-priority)
            return priority, forward or None
        metrics.unknown_objectives.inc()
        logger.debug("unknown InferenceObjective %r: the default priority", objective)
    return (-own if own is not None else 0), None


def tenant_of(headers: dict[str, str], tenant_header: str | None) -> str:
    if tenant_header and headers.get(tenant_header):
        return "h:" + headers[tenant_header]
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return "k:" + auth[7:].strip()
    return "anonymous"


def _clamp(value: int) -> int:
    return max(MIN_PRIORITY, min(MAX_PRIORITY, value))


class InferenceObjectiveWatch(EndpointSliceWatch):
    """The InferenceObjectives of one namespace (those whose poolRef names `pool`, or all),
    listed and watched like the EndpointSlices, into `table.watched`."""

    def __init__(self, api_url: str, namespace: str, table: ObjectiveTable,
                 pool: str | None = None, headers: dict | None = None,
                 verify: object = True) -> None:
        super().__init__(api_url, namespace, "", lambda _: None, headers=headers,
                         verify=verify)
        self.path = (f"{api_url.rstrip('/')}/apis/{OBJECTIVE_API}/namespaces/{namespace}"
                     "/inferenceobjectives")
        self.selector = ""
        self.table, self.pool = table, pool

    def _publish(self) -> None:
        watched = {}
        for name, obj in self.slices.items():
            spec = obj.get("spec") or {}
            if self.pool and (spec.get("poolRef") or {}).get("name") != self.pool:
                continue
            priority = spec.get("priority", 0)
            if isinstance(priority, int) and not isinstance(priority, bool):
                watched[name] = priority
        if watched != self.table.watched:
            logger.info("InferenceObjectives: %s", watched)
        self.table.watched = watched
