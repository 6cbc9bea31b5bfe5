"""/metrics: prometheus_client parses it; every documented quire: name is there with the
model_name label (and vLLM's names with --metrics-compat vllm); counters and histograms move
when requests are served."""

from __future__ import annotations

import pytest
import requests

from server_harness import SMOLLM_NAME, metric, metrics_of, server

GAUGES = ["quire:num_requests_running", "quire:num_requests_waiting",
          "quire:num_requests_swapped", "quire:kv_cache_usage_perc",
          "quire:kv_cache_blocks_total", "quire:kv_cache_blocks_used"]
COUNTERS = ["quire:num_preemptions_total", "quire:prefix_cache_queries_total",
            "quire:prefix_cache_hits_total", "quire:prompt_tokens_total",
            "quire:generation_tokens_total"]
HISTOGRAMS = ["quire:time_to_first_token_seconds", "quire:inter_token_latency_seconds",
              "quire:e2e_request_latency_seconds", "quire:request_queue_time_seconds"]
VLLM = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"]


@pytest.fixture(scope="module")
def srv():
    return server("smollm")


def test_every_documented_metric_is_exported_with_model_name(srv):
    r = requests.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = metrics_of(srv)
    names = GAUGES + COUNTERS + [h + suffix for h in HISTOGRAMS
                                 for suffix in ("_bucket", "_count", "_sum")] + VLLM
    for name in names:
        assert metric(samples, name, model_name=SMOLLM_NAME) >= 0, name
    for reason in ("stop", "length", "abort", "error"):
        metric(samples, "quire:request_success_total", model_name=SMOLLM_NAME,
               finished_reason=reason)
    assert metric(samples, "quire:kv_cache_blocks_total") > 0
    assert 0 <= metric(samples, "quire:kv_cache_usage_perc") <= 1


def test_counters_and_histograms_follow_requests(srv):
    before = metrics_of(srv)
    prompt = "The history of the Roman Empire spans many centuries and " * 6  # > 3 blocks
    for _ in range(2):  # the second one finds the first one's blocks in the prefix cache
        r = requests.post(srv.url + "/v1/completions",
                          json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200
    after = metrics_of(srv)

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("quire:generation_tokens_total") == 10
    assert grew("vllm:generation_tokens_total") == 10
    assert grew("quire:prompt_tokens_total") > 0
    assert grew("quire:request_success_total", finished_reason="length") == 2
    assert grew("quire:prefix_cache_queries_total") >= 2 * r.json()["usage"]["prompt_tokens"]
    assert grew("quire:prefix_cache_hits_total") >= 48  # three full 16-token blocks
    assert grew("quire:time_to_first_token_seconds_count") == 2
    assert grew("quire:e2e_request_latency_seconds_count") == 2
    assert grew("quire:request_queue_time_seconds_count") == 2
    assert grew("quire:inter_token_latency_seconds_count") == 8
    assert grew("vllm:time_per_output_token_seconds_count") == 8
    assert metric(after, "vllm:gpu_cache_usage_perc") == metric(after,
                                                                "quire:kv_cache_usage_perc")
