"""The LoRA metric families from LoRAStats snapshots: per-adapter running / waiting series
(0 while loaded and idle, gone once unloaded and unused), the loaded count, and vLLM's
lora_requests_info with only the current label set, exported whether or not the vLLM
names are on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from quire.engine.stats import EngineSnapshot, StepEvents
from quire.lora.stats import LoRAStats
from quire.metrics import ServerMetrics


def snapshot(lora):
    return EngineSnapshot(0, 0, 0, 10, 0, 0, 0.0, 0, 0, 0, {}, 0, 0, lora=lora)


def samples(m: ServerMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(m: ServerMetrics, name: str) -> dict:
    return {labels: v for (n, labels), v in samples(m).items() if n == name}


def test_lora_metrics_follow_the_snapshots():
    m = ServerMetrics("vllm")
    m.bind("base")
    m.record(snapshot(None), StepEvents())
    assert not series(m, "quire:lora_adapters_loaded")  # LoRA off: no LoRA families

    m.record(snapshot(LoRAStats(4, ("a", "b"), {"a": 2}, {"b": 1, "a": 1})), StepEvents())
    running = series(m, "quire:lora_requests_running")
    assert running == {(("adapter", "a"), ("model_name", "base")): 2.0,
                       (("adapter", "b"), ("model_name", "base")): 0.0}
    assert series(m, "quire:lora_requests_waiting")[
        (("adapter", "b"), ("model_name", "base"))] == 1.0
    assert list(series(m, "quire:lora_adapters_loaded").values()) == [2.0]
    info = series(m, "vllm:lora_requests_info")
    assert list(info) == [(("max_lora", "4"), ("running_lora_adapters", "a"),
                           ("waiting_lora_adapters", "a,b"))]

    # 'a' unloaded but one of its requests still runs; 'b' idle
    m.record(snapshot(LoRAStats(4, ("b",), {"a": 1}, {})), StepEvents())
    assert set(series(m, "quire:lora_requests_running").values()) == {1.0, 0.0}
    # and then finished: its series go; the info gauge keeps one (current) label set
    m.record(snapshot(LoRAStats(4, ("b",), {}, {})), StepEvents())
    assert series(m, "quire:lora_requests_running") == {
        (("adapter", "b"), ("model_name", "base")): 0.0}
    assert list(series(m, "vllm:lora_requests_info")) == [
        (("max_lora", "4"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]


def test_without_vllm_compat_lora_requests_info_is_the_one_vllm_name():
    m = ServerMetrics()
    m.bind("base")
    m.record(snapshot(None), StepEvents())
    assert not any(n.startswith("vllm:") for n, _ in samples(m))  # LoRA off: none at all
    m.record(snapshot(LoRAStats(1, ("a",), {"a": 1}, {})), StepEvents())
    names = {n for n, _ in samples(m)}
    assert "quire:lora_adapters_loaded" in names and "quire:lora_requests_running" in names
    assert {n for n in names if n.startswith("vllm:")} == {"vllm:lora_requests_info"}
    assert list(series(m, "vllm:lora_requests_info")) == [
        (("max_lora", "1"), ("running_lora_adapters", "a"), ("waiting_lora_adapters", ""))]


def test_vllm_compat_exports_lora_info_and_cache_config_from_the_start():
    """The endpoint picker of the Gateway API Inference Extension reads both; with LoRA off the
    info says so (max_lora 0) instead of missing, and LoRA's first snapshot replaces that set."""
    m = ServerMetrics("vllm", cache_config={"block_size": "32", "cache_dtype": "auto",
                                            "enable_prefix_caching": "True"})
    m.bind("base")
    m.record(snapshot(None), StepEvents())
    assert list(series(m, "vllm:lora_requests_info")) == [
        (("max_lora", "0"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]
    assert series(m, "vllm:cache_config_info") == {
        (("block_size", "32"), ("cache_dtype", "auto"), ("enable_prefix_caching", "True"),
         ("model_name", "base"), ("num_gpu_blocks", "10")): 1.0}
    m.record(snapshot(LoRAStats(2, ("a",), {}, {})), StepEvents())
    assert list(series(m, "vllm:lora_requests_info")) == [
        (("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]
