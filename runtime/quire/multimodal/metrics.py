"""The vision encoder's Prometheus families: the server's ServerMetrics makes them on the
first snapshot of a model that takes images (a text model exports none of them).

Public interface:
    EncoderMetrics(registry, model_name).record(counts)
        counts: the engine snapshot's encoder_cache dict, lifetime totals (hits, misses,
        images, seconds) and the cache's present size (entries, bytes)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# snapshot key -> (metric name, help)
COUNTERS = {
    "hits": ("quire:mm_encoder_cache_hits", "Images whose embeddings the encoder cache had "
             "(the vision encoder skipped)."),
    "misses": ("quire:mm_encoder_cache_misses", "Images the encoder cache lacked."),
    "images": ("quire:mm_encoder_images", "Images run through the vision encoder."),
    "seconds": ("quire:mm_encoder_seconds", "Seconds spent in the vision encoder (with "
                "quire:mm_encoder_images: the mean time per image)."),
}
GAUGES = {
    "entries": ("quire:mm_encoder_cache_entries", "Images held in the encoder cache."),
    "bytes": ("quire:mm_encoder_cache_bytes", "Bytes of embeddings in the encoder cache."),
}


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.counters = {k: Counter(n, d, ("model_name",), registry=registry).labels(model_name)
                         for k, (n, d) in COUNTERS.items()}
        self.gauges = {k: Gauge(n, d, ("model_name",), registry=registry).labels(model_name)
                       for k, (n, d) in GAUGES.items()}
        self._totals = dict.fromkeys(COUNTERS, 0.0)

    def record(self, counts: dict) -> None:
        for key, counter in self.counters.items():
            total = counts.get(key, 0)
            if total > self._totals[key]:
                counter.inc(total - self._totals[key])
                self._totals[key] = total
        for key, gauge in self.gauges.items():
            gauge.set(counts.get(key, 0))
