"""--kv-events-config '<json>': vLLM's KVEventsConfig keys and defaults.

    enable_kv_cache_events  bool   (false)
    publisher               "zmq" or "null"  ("zmq" once enabled)
    endpoint                "tcp://*:5557": bound when it holds `*`, else connected to (so
                            a central indexer can bind, as llm-d's does)
    replay_endpoint         null or e.g. "tcp://*:5558" (a ROUTER socket, always bound)
    buffer_steps            10000  batches kept for replay
    hwm                     100000 the PUB socket's send high-water mark
    max_queue_size          100000 batches waiting for the publisher thread
    topic                   ""     the first frame of every message
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from quire.validation import QuireValidationError, check_int

FIELD = "kv_events_config"
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: dict | str | None) -> KVEventsConfig | None:
        """None when off; raises QuireValidationError naming kv_events_config."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise QuireValidationError(FIELD, f"{FIELD} is not valid JSON ({e})",
                                           value) from None
        if not isinstance(value, dict):
            raise QuireValidationError(FIELD, f"{FIELD} must be a JSON object, got "
                                       f"{type(value).__name__}", value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise QuireValidationError(FIELD, f"{FIELD}: unknown key {unknown[0]!r}; the keys "
                                       f"are {', '.join(sorted(known))}", value)
        config = cls(**value)
        config._check()
        return config if config.enabled else None

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise QuireValidationError(FIELD, f"{FIELD}: enable_kv_cache_events must be true "
                                       "or false", self.enable_kv_cache_events)
        if self.publisher not in PUBLISHERS:
            raise QuireValidationError(FIELD, f"{FIELD}: publisher must be one of "
                                       f"{', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(self, name)
            if ep is None and name == "replay_endpoint":
                continue
            if not isinstance(ep, str) or "://" not in ep:
                raise QuireValidationError(FIELD, f"{FIELD}: {name} must be a ZMQ endpoint "
                                           f"such as tcp://*:5557, got {ep!r}", ep)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            check_int(f"{FIELD}: {name}", getattr(self, name), lo=1, field=FIELD)
        if not isinstance(self.topic, str):
            raise QuireValidationError(FIELD, f"{FIELD}: topic must be a string", self.topic)
