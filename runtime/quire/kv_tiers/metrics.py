"""The tiers' Prometheus families, with a `tier` label (host, disk, remote): the server's
ServerMetrics makes them on the first snapshot that has tiers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# snapshot key -> (metric name, help)
FAMILIES = {
    "hits": ("quire:kv_offload_hits", "KV blocks a prefix lookup found in the tier."),
    "misses": ("quire:kv_offload_misses", "Prefix lookups that ended on a block no tier held."),
    "stores": ("quire:kv_offload_stores", "KV blocks written to the tier."),
    "evictions": ("quire:kv_offload_evictions", "KV blocks dropped to keep the tier's size."),
    "errors": ("quire:kv_offload_errors", "Failed tier operations (unreachable server, bad "
               "file or value); each is a miss, never a failed request."),
    "bytes_stored": ("quire:kv_offload_stored_bytes", "Payload bytes written to the tier."),
    "bytes_loaded": ("quire:kv_offload_loaded_bytes", "Payload bytes read back on hits."),
    "load_seconds": ("quire:kv_offload_load_seconds", "Seconds spent reading the tier in "
                     "prefix lookups (with ..._lookups: the mean load latency)."),
    "num_loads": ("quire:kv_offload_lookups", "Prefix lookups that asked the tier."),
}


class TierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.counters = {key: Counter(name, doc, ("model_name", "tier"), registry=registry)
                         for key, (name, doc) in FAMILIES.items()}
        self._totals: dict[tuple[str, str], float] = {}

    def record(self, snapshot: dict[str, dict[str, float]]) -> None:
        """Lifetime totals in; what is new since the last call is added."""
        for tier, counts in snapshot.items():
            for key, counter in self.counters.items():
                total = counts.get(key, 0)
                new = total - self._totals.get((tier, key), 0)
                if new > 0:
                    counter.labels(self.model_name, tier).inc(new)
                    self._totals[(tier, key)] = total
                elif (tier, key) not in self._totals:
                    counter.labels(self.model_name, tier)  # present at 0
                    self._totals[(tier, key)] = total
