"""The router in front of fake replicas: load balancing, failures, disconnects, prefix routing."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from router_harness import InProcessRouter as router
from router_harness import (
    fake_backend,
    reset_fakes,
    router_state,
    running_fakes,
    server_harness,
    sse_texts,
    wait_until,
)


@pytest.fixture(scope="module")
def fakes():
    """Three fake replicas shared by the tests of this file (a, b, c), reset before each."""
    with running_fakes("abc", 11) as procs:
        yield procs


@pytest.fixture
def replicas(fakes):
    return reset_fakes(fakes)


def completion(r, prompt: str, stream: bool = False, **extra):
    return requests.post(r.url + "/v1/completions", json={"prompt": prompt, "stream": stream,
                                                          **extra},
                         stream=stream, timeout=60)


def router_metric(r, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(r.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def test_least_load_avoids_a_replica_whose_queue_is_full(replicas):
    a, b = replicas["a"], replicas["b"]
    with router("--routing", "least-load", "--backend", a.url, "--backend", b.url) as r:
        requests.post(a.url + "/control", json={"waiting": 50, "kv": 0.95}, timeout=5)
        wait_until(lambda: any(x["waiting"] == 50 for x in router_state(r)["backends"]), 30,
                   "the router to scrape a's queue")
        answered_by = [completion(r, f"hello {i}").json()["backend"] for i in range(8)]
        assert answered_by == ["b"] * 8
        # The queue drains: a is used again.
        requests.post(a.url + "/control", json={"waiting": 0, "kv": 0.0}, timeout=5)
        wait_until(lambda: all(x["waiting"] == 0 for x in router_state(r)["backends"]), 30,
                   "the router to see a's queue drain")
        assert {completion(r, f"again {i}").json()["backend"] for i in range(6)} == {"a", "b"}
        metrics = requests.get(r.url + "/metrics", timeout=5).text
        assert 'quire_router:routing_decisions_total{policy="least-load",reason="least_load"} 14.0' \
            in metrics
        # The other endpoints pass through too: /v1/models, and /generate's NUL-split stream.
        assert requests.get(r.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "fake"
        generated = requests.post(r.url + "/generate", json={"prompt": "x", "stream": True},
                                  stream=True, timeout=30)
        parts = [json.loads(p) for p in generated.content.split(b"\0") if p]
        assert [p["text"][0] for p in parts] == [f"{parts[0]['backend']}-{i} " for i in range(5)]


def test_a_replica_killed_mid_stream_breaks_only_its_own_stream():
    # Replicas of its own: one of them dies. Without migration (test_migration.py has it on)
    # its stream ends with an error event.
    with fake_backend("x", "127.0.0.16", chunks=40) as a, \
            fake_backend("y", "127.0.0.17", chunks=40) as b, \
            router("--routing", "least-load", "--backend", a.url, "--backend", b.url,
                   "--migration-limit", "0") as r:
        # The first stream asks its replica to die after two chunks; the second, sent while
        # the first runs, goes to the other replica (least-load) and must finish whole.
        doomed = completion(r, "__die__", stream=True)
        doomed_events = []
        lines = doomed.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith(b"data: "))[6:])
        doomed_events.append(first)
        healthy = completion(r, "fine", stream=True)
        healthy_events = sse_texts(healthy)
        for line in lines:
            if line.startswith(b"data: "):
                doomed_events.append(json.loads(line[6:]) if line[6:] != b"[DONE]" else "DONE")
        victim = first["backend"]
        assert healthy_events[-1] == {"done": True}
        assert {e["backend"] for e in healthy_events[:-1]} == ({"x", "y"} - {victim})
        assert len(healthy_events) == 41
        assert "DONE" not in doomed_events
        assert doomed_events[-1]["error"]["code"] == "upstream_failed"
        assert 2 <= len(doomed_events) - 1 < 40  # some chunks came, then the error
        # Later requests still succeed: the dead replica refuses connections, the router
        # retries on the live one before any byte was sent, then passes the dead one over.
        for i in range(6):
            after = completion(r, f"after {i}", max_tokens=2)
            assert after.status_code == 200 and after.json()["backend"] != victim
        assert router_metric(r, "quire_router:retries_total") <= 1


def test_a_request_refused_before_its_first_byte_is_retried_on_another_replica(replicas):
    a, b = replicas["a"], replicas["b"]
    with router("--routing", "round-robin", "--backend", a.url, "--backend", b.url) as r:
        requests.post(a.url + "/control", json={"status": 503}, timeout=5)  # a is full
        answers = [completion(r, f"q{i}") for i in range(4)]
        assert [x.status_code for x in answers] == [200] * 4
        assert {x.json()["backend"] for x in answers} == {"b"}
        # a's first turn was retried on b; then a was passed over while it cooled off.
        assert router_metric(r, "quire_router:retries_total") == 1
        requests.post(b.url + "/control", json={"status": 503}, timeout=5)
        refused = completion(r, "everyone is full")
        assert refused.status_code == 503  # the replicas' own answer, passed on
        assert refused.headers["Retry-After"] == "1"


def test_the_router_forwards_a_client_disconnect_to_the_replica(replicas):
    a = replicas["a"]
    with router("--backend", a.url) as r:
        stream = completion(r, "a long one", stream=True, max_tokens=2000)  # 100 s
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        assert requests.get(a.url + "/seen", timeout=5).json()["running"] == 1
        stream.close()  # the client goes away mid-stream
        wait_until(lambda: requests.get(a.url + "/seen", timeout=5).json()["running"] == 0, 30,
                   "the replica to see the disconnect")
        wait_until(lambda: router_state(r)["backends"][0]["in_flight"] == 0, 10,
                   "the router's in-flight count to drop")


def test_a_held_request_completes_once_a_replica_appears(replicas):
    with router("--admin-api", "--hold-timeout", "60") as r:
        result = {}

        def send():
            result["response"] = completion(r, "wait for me")

        t = threading.Thread(target=send, daemon=True)
        t.start()
        wait_until(lambda: router_state(r)["pending_requests"] == 1, 30, "the request to be held")
        assert "quire_router:pending_requests 1.0" in requests.get(r.url + "/metrics",
                                                                  timeout=5).text
        requests.post(r.url + "/router/backends", json={"url": replicas["c"].url}, timeout=5)
        t.join(30)
        assert result["response"].status_code == 200
        assert result["response"].json()["backend"] == "c"
        assert router_state(r)["pending_requests"] == 0
        assert 'quire_router:hold_seconds_count 1.0' in requests.get(r.url + "/metrics",
                                                                    timeout=5).text


def test_503_with_retry_after_when_the_hold_queue_is_full_or_the_hold_times_out():
    with router("--admin-api", "--max-pending", "1", "--hold-timeout", "2",
                "--retry-after", "7") as r:
        held = {}
        t = threading.Thread(target=lambda: held.update(response=completion(r, "first")),
                             daemon=True)
        t.start()
        wait_until(lambda: router_state(r)["pending_requests"] == 1, 30, "the request to be held")
        full = completion(r, "second")
        assert full.status_code == 503
        assert full.headers["Retry-After"] == "7"
        assert full.json()["error"]["code"] == "queue_full"
        t.join(60)
        assert held["response"].status_code == 503  # no replica in 2 s
        assert held["response"].json()["error"]["code"] == "hold_timeout"
        assert held["response"].headers["Retry-After"] == "7"


@pytest.fixture(scope="module")
def tokenizer_model():
    """A folder with the SmolLM2 tokenizer (the tiny model of the server tests), so the router
    loads a tokenizer in a second instead of converting the GGUF one."""
    return server_harness().tiny_model()


@pytest.mark.parametrize("routing", ["prefix-aware", "round-robin"])
def test_prefix_aware_sends_a_conversations_next_turn_to_the_same_replica(tokenizer_model,
                                                                           routing, replicas):
    a, b, c = replicas["a"], replicas["b"], replicas["c"]
    with router("--routing", routing, "--model", tokenizer_model, "--backend", a.url,
                   "--backend", b.url, "--backend", c.url) as r:
        conversations = {u: [{"role": "system", "content": f"Assistant of user {u}. "
                                                           + "You are helpful. " * 8}]
                         for u in range(5)}  # 5 users on 3 replicas: round-robin wanders
        replicas = {u: [] for u in conversations}
        for turn in range(3):
            for user, messages in conversations.items():
                messages.append({"role": "user", "content": f"user {user} says thing {turn}: "
                                                            + "and more words " * 6})
                answer = requests.post(r.url + "/v1/chat/completions",
                                       json={"messages": messages, "stream": False,
                                             "max_tokens": 2},
                                       timeout=60).json()
                replicas[user].append(answer["backend"])
                messages.append({"role": "assistant", "content": answer["text"]})
        sticky = [len(set(seen)) == 1 for seen in replicas.values()]
        if routing == "prefix-aware":
            assert all(sticky), replicas
            assert len({seen[0] for seen in replicas.values()}) > 1  # users spread out
        else:
            assert not all(sticky), replicas  # the baseline: turns wander


def decisions(r, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(r.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "quire_router:routing_decisions_total" and s.labels.get("reason") == reason)


def test_an_adapters_requests_are_routed_and_never_match_the_base_models_prefix(tokenizer_model,
                                                                                replicas):
    """A LoRA adapter is just another `model` to the router: proxied as is. Its KV blocks are
    salted in the engine, so the same prompt for the base model is no prefix hit for it."""
    a, b = replicas["a"], replicas["b"]
    with router("--routing", "prefix-aware", "--model", tokenizer_model, "--backend", a.url,
                "--backend", b.url) as r:
        prompt = "You are an assistant that writes SQL for the sales tables. " * 6
        answers = [completion(r, prompt, model=model, max_tokens=2)
                   for model in ("smollm2", "sql-lora", "sql-lora", "smollm2")]
        assert [x.status_code for x in answers] == [200] * 4
        backends = [x.json()["backend"] for x in answers]
        assert backends[2] == backends[1] and backends[3] == backends[0]
        assert (decisions(r, "prefix_miss"), decisions(r, "prefix_hit")) == (2, 2)


def test_salted_requests_are_kept_apart(tokenizer_model, replicas):
    """cache_salt seeds the router's hash chain as it does the engine's: the same prompt under
    another salt (or none) is no prefix hit, under the same salt it is, in chat too."""
    a, b = replicas["a"], replicas["b"]
    with router("--routing", "prefix-aware", "--model", tokenizer_model, "--backend", a.url,
                "--backend", b.url) as r:
        prompt = "You are the billing assistant of a small bakery in the old town. " * 6
        salts = ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b", None]
        answers = [completion(r, prompt, max_tokens=2,
                              **({} if salt is None else {"cache_salt": salt}))
                   for salt in salts]
        assert [x.status_code for x in answers] == [200] * len(salts)
        backends = [x.json()["backend"] for x in answers]
        assert backends[2] == backends[0] and backends[4] == backends[1] \
            and backends[5] == backends[3]
        assert (decisions(r, "prefix_miss"), decisions(r, "prefix_hit")) == (3, 3)
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        for salt in ("tenant-a", "tenant-c", "tenant-a"):
            requests.post(r.url + "/v1/chat/completions", json={**chat, "cache_salt": salt},
                          timeout=60).raise_for_status()
        assert (decisions(r, "prefix_miss"), decisions(r, "prefix_hit")) == (5, 4)


def test_a_request_for_an_adapter_goes_to_the_replicas_that_have_it_loaded(replicas):
    a, b, c = replicas["a"], replicas["b"], replicas["c"]
    requests.post(b.url + "/control", json={"models": ["fake", "sql"]}, timeout=5)
    with router("--routing", "round-robin", "--backend", a.url, "--backend", b.url,
                "--backend", c.url) as r:
        wait_until(lambda: all(x["models"] for x in router_state(r)["backends"]), 30,
                   "the router to read every replica's /v1/models")
        assert {completion(r, f"q {i}", model="sql").json()["backend"] for i in range(6)} == {"b"}
        # The base model, and a model no replica lists (each replica answers for itself): all.
        assert {completion(r, f"q {i}", model="fake").json()["backend"] for i in range(9)} == set("abc")
        assert {completion(r, f"q {i}", model="other").json()["backend"] for i in range(9)} == set("abc")
        # Loaded on a second replica: both share its requests from the next scrape on.
        requests.post(c.url + "/control", json={"models": ["fake", "sql"]}, timeout=5)
        wait_until(lambda: sum("sql" in x["models"] for x in router_state(r)["backends"]) == 2, 30,
                   "the router to see sql on c")
        assert {completion(r, f"q {i}", model="sql").json()["backend"] for i in range(6)} == {"b", "c"}
