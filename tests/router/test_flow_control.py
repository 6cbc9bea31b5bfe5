"""Flow control (issue 50): with every replica saturated, the router holds requests, lets them
go most important first and tenants in turn, sheds sheddable ones with 429, gives up after its
wait bound with a 503, and answers every request exactly once; the ext_proc picker decides the
same way. Fake replicas whose queue figures the tests set (fake_backend.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gateway_client import route
from router_harness import InProcessRouter as router
from router_harness import (
    free_port,
    reset_fakes,
    router_state,
    running_fakes,
    sse_texts,
    wait_until,
)

OBJECTIVE = "x-gateway-inference-objective"
TENANT = "x-gateway-inference-fairness-id"
OBJECTIVES = ("--objective", "chat=10", "--objective", "batch=0", "--objective", "evals=-1")


@pytest.fixture(scope="module")
def fakes():
    with running_fakes("pq", 51) as procs:
        yield procs


@pytest.fixture
def replicas(fakes):
    return reset_fakes(fakes)


def saturate(r, fakes, waiting: float) -> None:
    for p in fakes:
        requests.post(p.url + "/control", json={"waiting": waiting}, timeout=5)
    wait_until(lambda: all(b["waiting"] == waiting for b in router_state(r)["backends"]), 30,
               "the router to scrape the replicas' queues")


def metric(r, name: str, **labels) -> float:
    text = requests.get(r.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class Client(threading.Thread):
    """One streamed completion in a thread: its status, its events, when it began to flow."""

    def __init__(self, r, prompt: str, headers: dict | None = None, **body) -> None:
        super().__init__(daemon=True)
        self.r, self.prompt, self.headers, self.body = r, prompt, headers or {}, body
        self.status = None
        self.events: list[dict] = []
        self.answered = 0  # responses seen for this request (must end at 1)

    def run(self) -> None:
        response = requests.post(self.r.url + "/v1/completions", timeout=120, stream=True,
                                 headers=self.headers, json={"prompt": self.prompt,
                                                             "stream": True, "max_tokens": 3,
                                                             **self.body})
        self.status = response.status_code
        self.answered += 1
        if response.status_code == 200:
            self.events = sse_texts(response)


def seen(fake) -> list[str]:
    return [json.loads(p) for p in requests.get(fake.url + "/seen", timeout=5).json()["seen"]]


def test_a_saturated_pair_holds_orders_sheds_and_loses_nothing(replicas):
    p, q = replicas["p"], replicas["q"]
    # one dispatch per scrape (queue depth 1), scrapes 0.5 s apart: the order is the queue's
    with router("--backend", p.url, "--backend", q.url, "--saturation-queue-depth", "1",
                "--flow-max-wait", "60", "--scrape-interval", "0.5", *OBJECTIVES) as r:
        saturate(r, (p, q), 10)
        # Batch work first, then chat: all held while both replicas are saturated.
        held = [Client(r, f"batch{i}", {OBJECTIVE: "batch"}) for i in range(3)]
        held += [Client(r, f"chat{i}", {OBJECTIVE: "chat"}) for i in range(3)]
        held += [Client(r, "body-urgent", priority=-4)]  # vLLM's scale: GIE priority 4
        for i, c in enumerate(held):
            c.start()
            wait_until(lambda n=i + 1: router_state(r)["flow_control_queued"] == n, 30,
                       f"{i + 1} requests to wait")
        assert metric(r, "quire_router:flow_control_queued_requests", priority="10") == 3
        # Sheddable while saturated (an objective below 0, or a body priority above 0): 429.
        for headers, body in (({OBJECTIVE: "evals"}, {}), ({}, {"priority": 2})):
            shed = requests.post(r.url + "/v1/completions", headers=headers, timeout=30,
                                 json={"prompt": "sheddable", "max_tokens": 2, **body})
            assert shed.status_code == 429, shed.text
            assert int(shed.headers["retry-after"]) > 0
            assert "sheddable" in shed.json()["error"]["message"]
        assert metric(r, "quire_router:shed_requests_total") == 2
        assert seen(p) == seen(q) == []  # nothing reached a replica yet

        # Room on p only: the held requests go there one at a time, most important first.
        requests.post(p.url + "/control", json={"waiting": 0}, timeout=5)
        for c in held:
            c.join(60)
        order = seen(p)  # (within a priority, two sends may race to the replica)
        assert [set(order[:3]), order[3], set(order[4:])] == \
            [{"chat0", "chat1", "chat2"}, "body-urgent", {"batch0", "batch1", "batch2"}]
        assert seen(q) == []
        # Each answered exactly once, whole.
        for c in held:
            assert (c.status, c.answered) == (200, 1)
            assert c.events[-1] == {"done": True} and len(c.events) == 4
        # Idle now: a sheddable request is served.
        saturate(r, (p, q), 0)
        served = requests.post(r.url + "/v1/completions", headers={OBJECTIVE: "evals"},
                               timeout=30, json={"prompt": "evals-when-idle", "max_tokens": 2})
        assert served.status_code == 200
        assert metric(r, "quire_router:flow_control_wait_seconds_count") == 7


def test_a_flooding_tenant_does_not_hold_up_another_beyond_two_turns(replicas):
    """Tenant A queues 12 requests, then tenant B 2, all of one priority. Tenants take turns,
    so each of B's requests goes within two dispatches of its turn: B's are among the first
    four sent (A1 B1 A2 B2 ...), where first come, first served would send them 13th and 14th."""
    p, q = replicas["p"], replicas["q"]
    with router("--backend", p.url, "--backend", q.url, "--saturation-queue-depth", "1",
                "--scrape-interval", "0.5") as r:
        saturate(r, (p, q), 10)
        clients = [Client(r, f"A{i}", {TENANT: "tenant-a"}) for i in range(12)]
        clients += [Client(r, f"B{i}", {TENANT: "tenant-b"}) for i in range(2)]
        for i, c in enumerate(clients):
            c.start()
            wait_until(lambda n=i + 1: router_state(r)["flow_control_queued"] == n, 30,
                       f"{i + 1} requests to wait")
        requests.post(p.url + "/control", json={"waiting": 0}, timeout=5)
        for c in clients:
            c.join(90)
        assert sorted(seen(p)) == sorted(c.prompt for c in clients)
        # the router's own release order (the replica may see two back-to-back sends swapped)
        tenants = [t["tenant"][-1].upper() for t in router_state(r)["flow_control_releases"]]
        assert tenants == list("ABAB") + ["A"] * 10, tenants
        assert all(c.status == 200 and c.answered == 1 for c in clients)


def test_the_wait_bound_gives_a_503_and_bad_priorities_a_400(replicas):
    p, q = replicas["p"], replicas["q"]
    with router("--backend", p.url, "--backend", q.url, "--flow-max-wait", "1", "--retry-after",
                "7", *OBJECTIVES) as r:
        for bad in ("high", 1.5, 2 ** 31, True, None):
            answer = requests.post(r.url + "/v1/completions", timeout=30,
                                   json={"prompt": "x", "priority": bad})
            assert answer.status_code == 400, (bad, answer.text)
            assert answer.json()["error"]["param"] == "priority"
        # An unknown objective: the default priority (counted), never an error.
        unknown = requests.post(r.url + "/v1/completions", headers={OBJECTIVE: "nope"},
                                timeout=30, json={"prompt": "x", "max_tokens": 2})
        assert unknown.status_code == 200
        assert metric(r, "quire_router:unknown_objectives_total") == 1
        # A known objective on a request without a JSON object body: nothing to put the
        # priority in, so it goes on as it came (the replica answers it), never a 500.
        models = requests.get(r.url + "/v1/models", headers={OBJECTIVE: "chat"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"]
        for body in (b"[1, 2]", b"not json"):
            answer = requests.post(r.url + "/v1/completions", headers={OBJECTIVE: "chat"},
                                   data=body, timeout=30)
            assert answer.status_code == requests.post(p.url + "/v1/completions", data=body,
                                                       timeout=30).status_code, answer.text
        saturate(r, (p, q), 10)
        started = time.monotonic()
        late = requests.post(r.url + "/v1/completions", timeout=30,
                             json={"prompt": "waits", "max_tokens": 2})
        assert late.status_code == 503 and late.headers["retry-after"] == "7"
        assert "saturated" in late.json()["error"]["message"]
        assert 0.9 <= time.monotonic() - started < 10
        assert metric(r, "quire_router:rejected_requests_total", reason="flow_timeout") == 1


def test_replicas_that_died_saturated_fail_fast_instead_of_holding():
    """A replica that stops answering keeps no say: its last figures (saturated) made every
    request wait the whole bound for room that could never come; with no live replica the
    request fails at once, as without saturation."""
    with running_fakes("d", 61) as fakes:
        d = fakes["d"]
        with router("--backend", d.url, "--flow-max-wait", "120", "--scrape-interval", "0.2",
                    "--saturation-queue-depth", "1") as r:
            saturate(r, (d,), 10)
            shed = requests.post(r.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 2, "priority": 2})
            assert shed.status_code == 429  # alive and saturated: sheddable work is shed
            d.stop()
            wait_until(lambda: router_state(r)["backends"][0].get("down"), 30,
                       "the router to find the replica gone")
            for body in ({}, {"priority": 2}):
                started = time.monotonic()
                answer = requests.post(r.url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 2, **body})
                assert answer.status_code == 502, answer.text
                assert time.monotonic() - started < 60  # not the 120 s bound: at once


def test_the_endpoint_picker_makes_the_same_decisions(replicas):
    p, q = replicas["p"], replicas["q"]
    host = "127.0.0.50"
    with router("--ext-proc-port", str(free_port(host)), "--backend", p.url, "--backend", q.url,
                "--saturation-queue-depth", "1", *OBJECTIVES, host=host) as r:
        target = f"{host}:{r.ns.ext_proc_port}"
        body = json.dumps({"model": "fake", "prompt": "x", "max_tokens": 2}).encode()

        async def gateway():
            bad = await route(target, "/v1/completions",
                              json.dumps({"prompt": "x", "priority": "high"}).encode())
            saturate(r, (p, q), 10)
            shed = await route(target, "/v1/completions", body, headers={OBJECTIVE: "evals"})
            waiting = asyncio.ensure_future(route(target, "/v1/completions", body,
                                                  headers={OBJECTIVE: "chat"}))
            await asyncio.to_thread(wait_until, lambda: router_state(r)["flow_control_queued"]
                                    == 1, 30, "the chat request to wait")
            requests.post(q.url + "/control", json={"waiting": 0}, timeout=5)
            return bad, shed, await waiting

        bad, shed, waited = asyncio.run(gateway())
        assert bad.status == 400 and "priority" in bad.error["message"]
        assert shed.status == 429
        assert waited.status is None and waited.destination == q.url.split("//", 1)[1]
