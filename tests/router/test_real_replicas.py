"""The router in front of two real `quire serve` processes (a tiny random Llama), and what an
external Gateway API Inference Extension endpoint picker reads from those processes."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from router_harness import quire_serve, router, server_harness, wait_until

LONG = 900  # tokens: far more than a test waits for (the tiny model allows 1024 positions)


@pytest.fixture(scope="module")
def tiny():
    return server_harness().tiny_model()


@pytest.fixture(scope="module")
def replicas(tiny):
    args = [tiny, "--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1",
            "--max-num-seqs", "8", "--metrics-compat", "vllm"]
    procs = [quire_serve("a", "127.0.0.31", *args), quire_serve("b", "127.0.0.32", *args)]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready(300)
        yield procs
    finally:
        for p in procs:
            p.stop()


def families(url: str) -> dict[str, object]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(url: str, name: str) -> float:
    """One gauge or counter, summed over its samples (prometheus_client drops `_total` from
    counter family names; the sample keeps it)."""
    fam = families(url)[name]
    return sum(s.value for s in fam.samples if s.name in (name, name + "_total"))


def test_real_replicas_stream_through_the_router_and_disconnects_abort(replicas, tiny):
    with router("--routing", "prefix-aware", "--model", tiny, "--block-size", "16",
                *[f"--backend={p.url}" for p in replicas]) as r:
        # A whole answer, then the same long prompt again: the second lands where the first
        # did and hits that replica's prefix cache.
        prompt = "the quick brown fox jumps over the lazy dog " * 12
        hits_before = {p.url: value(p.url, "quire:prefix_cache_hits") for p in replicas}
        for _ in range(2):
            answer = requests.post(r.url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
        hits = {p.url: value(p.url, "quire:prefix_cache_hits") - hits_before[p.url]
                for p in replicas}
        assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] >= 16 * 4, hits

        # A stream read a little, then dropped: the replica aborts it.
        aborted_before = sum(value(p.url, "quire:request_success") for p in replicas)
        stream = requests.post(r.url + "/v1/completions", stream=True, timeout=120, json={
            "prompt": "one two three", "max_tokens": LONG, "ignore_eos": True, "stream": True})
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert [next(lines) for _ in range(4)]
        assert sum(value(p.url, "quire:num_requests_running") for p in replicas) == 1
        stream.close()
        wait_until(lambda: sum(value(p.url, "quire:num_requests_running") for p in replicas)
                   == 0, 60, "the replica to abort the request")
        finished = sum(value(p.url, "quire:request_success") for p in replicas)
        assert finished == aborted_before + 1  # finished (as an abort), not run to the end
        assert sum(value(p.url, "quire:kv_cache_blocks_used") for p in replicas) == 0


# What the GIE endpoint picker scrapes (its model-server protocol names vLLM's metrics):
# queue (TotalQueuedRequests), running (TotalRunningRequests) and KV-cache utilization
# (KVCacheUtilization: vllm:gpu_cache_usage_perc in older vLLM, vllm:kv_cache_usage_perc now).
GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
              "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def test_vllm_metric_names_serve_an_external_endpoint_picker(replicas):
    pod = replicas[0].url
    fams = families(pod)
    for name in GIE_GAUGES:
        assert name in fams, f"{name} missing from /metrics"
        assert fams[name].type == "gauge"
        assert all("model_name" in s.labels for s in fams[name].samples)
    # The figures move with the work, as the picker's scoring assumes.
    stream = requests.post(pod + "/v1/completions", stream=True, timeout=120, json={
        "prompt": "count with me", "max_tokens": LONG, "ignore_eos": True, "stream": True})
    lines = stream.iter_lines()
    assert [next(lines) for _ in range(4)]
    assert value(pod, "vllm:num_requests_running") == 1
    assert 0 < value(pod, "vllm:kv_cache_usage_perc") == value(pod, "vllm:gpu_cache_usage_perc")
    stream.close()
    wait_until(lambda: value(pod, "vllm:num_requests_running") == 0, 60, "the abort")
    assert value(pod, "vllm:num_requests_waiting") == 0


def labels_of(url: str, name: str) -> list[dict]:
    return [s.labels for s in families(url)[name].samples]


def test_endpoint_picker_reads_the_cache_config_and_lora_info(replicas):
    """GIE's model-server protocol also reads vllm:cache_config_info (block_size, for prefix
    scoring) and vllm:lora_requests_info, which must be there with LoRA off too."""
    pod = replicas[0].url
    (cache,) = labels_of(pod, "vllm:cache_config_info")
    assert cache["block_size"] == "16"  # the runtime's default, which these replicas use
    assert int(cache["num_gpu_blocks"]) == value(pod, "quire:kv_cache_blocks_total") > 0
    assert cache["enable_prefix_caching"] == "True" and cache["cache_dtype"] == "auto"
    assert value(pod, "vllm:cache_config_info") == 1
    (lora,) = labels_of(pod, "vllm:lora_requests_info")
    assert lora == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
