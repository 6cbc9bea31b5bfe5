"""The router's own Prometheus metrics (its /metrics), in a registry of its own.

`quire_router:pending_requests` (held for want of a ready replica) and
`quire_router:last_request_timestamp_seconds` / `quire_router:idle_seconds` are what the
operator's scale-to-zero reads: pending > 0 scales 0 -> 1, a long enough idle scales to 0.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.pending = Gauge("quire_router:pending_requests",
                             "Requests held because no replica is ready.", registry=r)
        self.backends = Gauge("quire_router:backends", "Ready replicas known to the router.",
                              registry=r)
        self.in_flight = Gauge("quire_router:backend_in_flight_requests",
                               "Requests the router has open on each replica.", ("backend",),
                               registry=r)
        self.decisions = Counter("quire_router:routing_decisions",
                                 "Routing decisions, by policy and reason.",
                                 ("policy", "reason"), registry=r)
        self.retries = Counter("quire_router:retries",
                               "Requests sent to another replica after one failed before its "
                               "first byte, by what failed.", ("reason",), registry=r)
        self.rejected = Counter("quire_router:rejected_requests",
                                "Requests answered 503 by the router itself, by why.",
                                ("reason",), registry=r)
        self.requests = Counter("quire_router:requests", "Requests received.", registry=r)
        # flow control (flow_control.py) and priorities (objectives.py)
        self.flow_queued = Gauge("quire_router:flow_control_queued_requests",
                                 "Requests waiting because every replica is saturated, by "
                                 "priority (GIE's: higher first).", ("priority",), registry=r)
        self.flow_wait_seconds = Histogram("quire_router:flow_control_wait_seconds",
                                           "How long requests waited for a replica with room.",
                                           buckets=HOLD_BUCKETS, registry=r)
        self.shed = Counter("quire_router:shed_requests",
                            "Sheddable requests (priority < 0) answered 429 while every "
                            "replica was saturated.", ("reason",), registry=r)
        self.unknown_objectives = Counter(
            "quire_router:unknown_objectives", "Requests naming an InferenceObjective the "
            "router does not know (they got the default priority).", registry=r)
        # request migration (migration.py)
        self.migrations = Counter("quire_router:migrations",
                                  "Requests sent on to another replica after theirs broke off "
                                  "(connection_lost, aborted, error_event).", ("reason",),
                                  registry=r)
        self.migration_failures = Counter(
            "quire_router:migration_failures", "Broken streams no replica could continue "
            "(they ended with an error event).", registry=r)
        self.hold_seconds = Histogram("quire_router:hold_seconds",
                                      "How long held requests waited for a replica.",
                                      buckets=HOLD_BUCKETS, registry=r)
        self.last_request = Gauge("quire_router:last_request_timestamp_seconds",
                                  "Unix time of the last request received (the router's start "
                                  "until one arrives).", registry=r)
        self.last_first_byte = Gauge("quire_router:last_first_byte_timestamp_seconds",
                                     "Unix time a replica last sent the first byte of an "
                                     "answer (0 until one does): the end of a cold start.",
                                     registry=r)
        self.idle = Gauge("quire_router:idle_seconds",
                          "Seconds since the last request was received.", registry=r)
        self.last_request_time = time.time()
        self.last_request.set(self.last_request_time)
        self.idle.set_function(lambda: max(0.0, time.time() - self.last_request_time))

    def request_arrived(self) -> None:
        self.requests.inc()
        self.last_request_time = time.time()
        self.last_request.set(self.last_request_time)

    def first_byte(self) -> None:
        self.last_first_byte.set(time.time())

    def render(self, backends) -> bytes:
        self.backends.set(len(backends))
        self.in_flight.clear()
        for b in backends.all():
            self.in_flight.labels(backend=b.url).set(b.in_flight)
        return generate_latest(self.registry)
