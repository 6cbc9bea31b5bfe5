"""Prometheus metrics for the server, from the engine's snapshots and step events.

Every figure is exported as `quire:*` with a `model_name` label; the operator's autoscaler
reads `quire:num_requests_waiting` and `quire:kv_cache_usage_perc`, so these names are a
contract. With `compat="vllm"` the same figures are also exported under vLLM's names (both
`vllm:kv_cache_usage_perc` and the older `vllm:gpu_cache_usage_perc`), so dashboards and KEDA
triggers written for vLLM work unchanged. Each ServerMetrics has its own CollectorRegistry.

With LoRA on (the snapshot carries LoRAStats), three more families appear:
`quire:lora_adapters_loaded`, and `quire:lora_requests_running` / `quire:lora_requests_waiting`
with an `adapter` label (a series per loaded adapter, 0 when idle; an adapter's series goes
once it is unloaded and nothing uses it), and alongside them, whatever `compat`, vLLM's
`vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` (names
comma-joined, value the time of the update), which LoRA-aware routers and endpoint pickers
read; unlike vLLM, only the current label set is exported, not one series per set ever seen.

With KV tiers on (`--kv-offloading-*`), `quire:kv_offload_{hits,misses,stores,evictions,errors,
stored_bytes,loaded_bytes,load_seconds,lookups}_total` with a `tier` label (kv_tiers/metrics.py).

With `compat="vllm"` the server also exports what the Gateway API Inference Extension's
endpoint picker reads besides the queue and KV figures: `vllm:lora_requests_info` even with
LoRA off (max_lora "0", no adapters: the picker treats a missing family as a failed scrape), and
`vllm:cache_config_info{block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching}` (value
1; num_gpu_blocks is the KV block pool's size, on a CPU too), for prefix-aware scoring.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from quire.engine.stats import EngineSnapshot, StepEvents
from quire.outputs import RequestOutput

logger = logging.getLogger(__name__)

COMPAT_CHOICES = ("none", "vllm")
# vllm:cache_config_info's labels (vLLM's names) besides model_name
CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so histograms line up on shared dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# tokens per request, 1-2-5 steps as vLLM's request_prompt_tokens (there up to max_model_len)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000,
                       50_000, 100_000, 200_000, 500_000, 1_000_000)

# seconds filling one step's grammar masks: ~70 us a sequence, more for big batches
GRAMMAR_MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                        0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class _Spec:
    key: str
    kind: type
    name: str                          # quire:... (counters without the _total suffix)
    vllm: tuple[str, ...]              # vLLM's names for the same figure
    doc: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()       # beyond model_name


SPECS = (
    _Spec("running", Gauge, "quire:num_requests_running", ("vllm:num_requests_running",),
          "Sequences in the running batch."),
    _Spec("waiting", Gauge, "quire:num_requests_waiting", ("vllm:num_requests_waiting",),
          "Sequences waiting to be scheduled."),
    _Spec("waiting_by_priority", Gauge, "quire:num_requests_waiting_by_priority", (),
          "Sequences waiting, by priority band (the priority for -10..10, else below_-10 / "
          "above_10).", labels=("priority",)),
    _Spec("running_by_priority", Gauge, "quire:num_requests_running_by_priority", (),
          "Sequences running, by priority band (as above).", labels=("priority",)),
    _Spec("swapped", Gauge, "quire:num_requests_swapped", ("vllm:num_requests_swapped",),
          "Sequences swapped out to host memory."),
    _Spec("kv_usage", Gauge, "quire:kv_cache_usage_perc",
          ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
          "Fraction of KV-cache blocks in use (0 to 1)."),
    _Spec("blocks_total", Gauge, "quire:kv_cache_blocks_total", (),
          "KV-cache blocks in the pool."),
    _Spec("blocks_used", Gauge, "quire:kv_cache_blocks_used", (),
          "KV-cache blocks held by requests."),
    _Spec("preemptions", Counter, "quire:num_preemptions", ("vllm:num_preemptions",),
          "Preemptions (recompute and swap)."),
    _Spec("prefix_queries", Counter, "quire:prefix_cache_queries",
          ("vllm:prefix_cache_queries",), "Prompt tokens looked up in the prefix cache."),
    _Spec("prefix_hits", Counter, "quire:prefix_cache_hits", ("vllm:prefix_cache_hits",),
          "Prompt tokens found in the prefix cache."),
    _Spec("prompt_tokens", Counter, "quire:prompt_tokens", ("vllm:prompt_tokens",),
          "Prompt tokens computed (prefill)."),
    _Spec("generation_tokens", Counter, "quire:generation_tokens", ("vllm:generation_tokens",),
          "Tokens generated."),
    _Spec("request_success", Counter, "quire:request_success", ("vllm:request_success",),
          "Finished sequences, by finish reason (stop, length, abort, error).",
          labels=("finished_reason",)),
    _Spec("spec_drafts", Counter, "quire:spec_decode_num_drafts",
          ("vllm:spec_decode_num_drafts",), "Sequences that verified proposals (one a step)."),
    _Spec("spec_draft_tokens", Counter, "quire:spec_decode_num_draft_tokens",
          ("vllm:spec_decode_num_draft_tokens",), "Proposed tokens verified."),
    _Spec("spec_accepted_tokens", Counter, "quire:spec_decode_num_accepted_tokens",
          ("vllm:spec_decode_num_accepted_tokens",), "Proposed tokens accepted."),
    _Spec("spec_accepted_per_pos", Counter, "quire:spec_decode_num_accepted_tokens_per_pos",
          ("vllm:spec_decode_num_accepted_tokens_per_pos",),
          "Proposed tokens accepted, by their position among a step's proposals (0: first).",
          labels=("position",)),
    _Spec("ttft", Histogram, "quire:time_to_first_token_seconds",
          ("vllm:time_to_first_token_seconds",), "Time to first token.", TTFT_BUCKETS),
    _Spec("itl", Histogram, "quire:inter_token_latency_seconds",
          ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
          "Time between two output tokens of a sequence.", ITL_BUCKETS),
    _Spec("e2e", Histogram, "quire:e2e_request_latency_seconds",
          ("vllm:e2e_request_latency_seconds",), "Arrival to last token.", REQUEST_BUCKETS),
    _Spec("queue", Histogram, "quire:request_queue_time_seconds",
          ("vllm:request_queue_time_seconds",), "Arrival to first scheduling.",
          REQUEST_BUCKETS),
    _Spec("prompt_tokens_cached", Counter, "quire:prompt_tokens_cached",
          ("vllm:prompt_tokens_cached",), "Prompt tokens served from the prefix cache, over "
          "finished requests."),
    # vLLM has no per-request histogram of this figure, only the counter above
    _Spec("cached_tokens", Histogram, "quire:request_prompt_cached_tokens", (),
          "Prompt tokens of a request served from the prefix cache (usage's "
          "prompt_tokens_details.cached_tokens).", TOKEN_COUNT_BUCKETS),
    _Spec("structured_requests", Counter, "quire:structured_output_requests", (),
          "Requests with a grammar (response_format, guided_*, tool_choice required or "
          "named)."),
    _Spec("grammar_mask", Histogram, "quire:grammar_mask_time_seconds", (),
          "Time one step spent computing its sequences' grammar masks.",
          GRAMMAR_MASK_BUCKETS),
)


def cache_config_labels(block_size: int, cache_dtype: str, enable_prefix_caching: bool) -> dict[str, str]:
    """vllm:cache_config_info's labels that are known before the engine sizes its pool."""
    return {"block_size": str(block_size), "cache_dtype": cache_dtype,
            "enable_prefix_caching": str(bool(enable_prefix_caching))}


class ServerMetrics:
    """Metric families exist from construction; samples appear once `bind(model_name)`.

    cache_config: `cache_config_labels(...)` of the engine, for vllm:cache_config_info (exported
    with compat="vllm" once the first snapshot gives the pool's size)."""

    def __init__(self, compat: str = "none", cache_config: dict[str, str] | None = None) -> None:
        if compat not in COMPAT_CHOICES:
            raise ValueError(f"metrics_compat must be one of {', '.join(COMPAT_CHOICES)}; "
                             f"got {compat!r}")
        self.registry = CollectorRegistry()
        self.model_name: str | None = None
        self._families: dict[str, list] = {}
        self._children: dict[str, list] = {}
        self._totals = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}
        self.compat = compat
        self._lora: _LoRAMetrics | None = None  # made on the first snapshot with LoRA on
        self._tiers = None  # kv_tiers.metrics.TierMetrics, on the first snapshot with tiers
        self._encoder = None  # multimodal.metrics.EncoderMetrics, for a model taking images
        # vLLM's LoRA info: from the start with compat="vllm", else with LoRA's first snapshot
        self._lora_info = _LoRAInfo(self.registry) if compat == "vllm" else None
        self._cache_config = dict(cache_config or {})
        self._cache_info = (Gauge("vllm:cache_config_info", "Information of the KV cache's configuration.",
                                  ("model_name", *CACHE_INFO_LABELS), registry=self.registry)
                            if compat == "vllm" else None)
        self._cache_info_labels: tuple[str, ...] | None = None
        # the server's own figure (not the engine's): clients that went away mid-request
        self.client_disconnects = Counter(
            "quire:client_disconnects", "Requests whose client went away before the answer "
            "ended (their engine requests were aborted).", registry=self.registry)
        for spec in SPECS:
            names = (spec.name,) + (spec.vllm if compat == "vllm" else ())
            kwargs = {"buckets": spec.buckets} if spec.kind is Histogram else {}
            self._families[spec.key] = [
                spec.kind(name, spec.doc, ("model_name",) + spec.labels,
                          registry=self.registry, **kwargs)
                for name in names]

    def bind(self, model_name: str) -> None:
        self.model_name = model_name
        for spec in SPECS:
            if not spec.labels:
                self._children[spec.key] = [f.labels(model_name=model_name)
                                            for f in self._families[spec.key]]
        for reason in ("stop", "length", "abort", "error"):  # present at 0 from the start
            self._reason(reason)
        if self._lora_info is not None and self._lora_info.labels is None:
            self._lora_info.set("0", "", "")  # LoRA off until a snapshot says otherwise

    def _reason(self, reason: str) -> list:
        return [f.labels(model_name=self.model_name, finished_reason=reason)
                for f in self._families["request_success"]]

    # --- updates (from the engine loop, between steps) -----------------------------------
    def record(self, snap: EngineSnapshot, ev: StepEvents) -> None:
        if self.model_name is None:
            return
        self._set("running", snap.num_running)
        self._set("waiting", snap.num_waiting)
        self._set("swapped", snap.num_swapped)
        for key, counts in (("waiting_by_priority", snap.waiting_by_priority),
                            ("running_by_priority", snap.running_by_priority)):
            for family in self._families[key]:
                family.clear()  # bands that emptied go away
                for band, n in counts.items():
                    family.labels(model_name=self.model_name, priority=band).set(n)
        self._set("kv_usage", snap.kv_usage)
        self._set("blocks_total", snap.blocks_total)
        self._set("blocks_used", snap.blocks_used)
        self._advance("preemptions", sum(snap.preemptions.values()))
        self._advance("prefix_queries", snap.prefix_queries)
        self._advance("prefix_hits", snap.prefix_hits)
        self._inc("prompt_tokens", ev.prompt_tokens)
        self._inc("generation_tokens", ev.generation_tokens)
        self._inc("structured_requests", ev.structured_requests)
        self._inc("spec_drafts", ev.spec_drafts)
        self._inc("spec_draft_tokens", ev.spec_draft_tokens)
        self._inc("spec_accepted_tokens", ev.spec_accepted_tokens)
        for position, n in enumerate(ev.spec_accepted_per_position):
            for family in self._families["spec_accepted_per_pos"]:
                family.labels(model_name=self.model_name, position=str(position)).inc(n)
        if snap.lora is not None:
            if self._lora is None:
                if self._lora_info is None:
                    self._lora_info = _LoRAInfo(self.registry)
                self._lora = _LoRAMetrics(self.registry, self.model_name, self._lora_info)
            self._lora.record(snap.lora)
        if snap.kv_tiers is not None:
            if self._tiers is None:
                from quire.kv_tiers.metrics import TierMetrics
                self._tiers = TierMetrics(self.registry, self.model_name)
            self._tiers.record(snap.kv_tiers)
        if snap.encoder_cache is not None:
            if self._encoder is None:
                from quire.multimodal.metrics import EncoderMetrics
                self._encoder = EncoderMetrics(self.registry, self.model_name)
            self._encoder.record(snap.encoder_cache)
        if self._cache_info is not None:
            self._record_cache_info(snap.blocks_total)
        for key, values in (("ttft", ev.time_to_first_token), ("itl", ev.inter_token_latency),
                            ("e2e", ev.e2e_latency), ("queue", ev.queue_time),
                            ("grammar_mask", ev.grammar_mask_time)):
            for v in values:
                if v is not None and math.isfinite(v):
                    for child in self._children[key]:
                        child.observe(max(0.0, v))

    def _record_cache_info(self, num_blocks: int) -> None:
        labels = {**self._cache_config, "num_gpu_blocks": str(num_blocks)}
        values = (self.model_name, *(labels.get(key, "") for key in CACHE_INFO_LABELS))
        if values == self._cache_info_labels:
            return
        if self._cache_info_labels is not None:
            self._cache_info.remove(*self._cache_info_labels)
        self._cache_info_labels = values
        self._cache_info.labels(*values).set(1)

    def record_finished(self, output: RequestOutput) -> None:
        """One count per finished sequence of a finished request (aborts and errors too), and
        its cached prompt tokens, if it was ever scheduled."""
        if self.model_name is None:
            return
        for c in output.outputs:
            for child in self._reason(c.finish_reason or "abort"):
                child.inc()
        if output.metrics.first_scheduled_time is not None:
            for child in self._children["cached_tokens"]:
                child.observe(output.num_cached_tokens)
            self._inc("prompt_tokens_cached", output.num_cached_tokens)

    def record_disconnect(self) -> None:
        self.client_disconnects.inc()

    def _set(self, key: str, value: float) -> None:
        for child in self._children[key]:
            child.set(value)

    def _inc(self, key: str, amount: float) -> None:
        if amount > 0:
            for child in self._children[key]:
                child.inc(amount)

    def _advance(self, key: str, total: int) -> None:
        """Counters the engine keeps as lifetime totals: add what is new since last time."""
        self._inc(key, total - self._totals[key])
        self._totals[key] = max(total, self._totals[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoRAInfo:
    """vllm:lora_requests_info: one series, the current label set, valued at its update time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                           registry=registry)
        self.labels: tuple[str, str, str] | None = None

    def set(self, max_lora: str, waiting: str, running: str) -> None:
        labels = (max_lora, waiting, running)
        if self.labels is not None and labels != self.labels:
            self.gauge.remove(*self.labels)
        self.labels = labels
        self.gauge.labels(*labels).set(time.time())


class _LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, info: _LoRAInfo) -> None:
        self.model_name = model_name
        self.loaded = Gauge("quire:lora_adapters_loaded", "LoRA adapters loaded (servable).",
                            ("model_name",), registry=registry).labels(model_name=model_name)
        self.by_adapter = {
            key: Gauge(f"quire:lora_requests_{key}",
                       f"Sequences {key} with each LoRA adapter.",
                       ("model_name", "adapter"), registry=registry)
            for key in ("running", "waiting")}
        self.adapters: set[str] = set()  # the adapter label values exported
        # vLLM's name with or without compat="vllm": routers read it for LoRA affinity
        self.info = info

    def record(self, stats) -> None:
        """stats: quire.lora.stats.LoRAStats."""
        self.loaded.set(len(stats.loaded))
        names = set(stats.loaded) | set(stats.running) | set(stats.waiting)
        for gone in self.adapters - names:
            for gauge in self.by_adapter.values():
                gauge.remove(self.model_name, gone)
        self.adapters = names
        for name in names:
            self.by_adapter["running"].labels(self.model_name, name).set(
                stats.running.get(name, 0))
            self.by_adapter["waiting"].labels(self.model_name, name).set(
                stats.waiting.get(name, 0))
        self.info.set(str(stats.max_loras), ",".join(sorted(stats.waiting)),
                      ",".join(sorted(stats.running)))
