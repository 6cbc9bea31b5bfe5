"""Readiness while the model loads, the queue limit, SIGTERM draining, and the engine loop's
death (which must end the process, non-zero, after telling every client)."""

from __future__ import annotations

import json
import signal
import threading
import time

import requests

from server_harness import server

LONG = 1000
# Requests that cannot finish on their own within any test (fault_launcher.py makes every step
# sleep while one runs: 1000 tokens take at least 50 s, however fast the machine).
SLOW = "__slow__ "


class Stream:
    """A streaming completion; keeps one line iterator (dropping an iterator lets urllib3
    close the connection, which the server rightly takes for a client that went away)."""

    def __init__(self, srv, prompt: str, max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        self.resp = requests.post(srv.url + "/v1/completions", json=body, stream=True,
                                  timeout=120)
        self.status_code = self.resp.status_code
        self.lines = self.resp.iter_lines()
        self.events: list = []

    def next_event(self):
        for line in self.lines:
            if line.startswith(b"data: "):
                data = line[6:]
                event = data.decode() if data == b"[DONE]" else json.loads(data)
                self.events.append(event)
                return event
        return None

    def read_all(self) -> list:
        while self.next_event() is not None:
            pass
        return self.events

    def close(self) -> None:
        self.resp.close()


def _finish_reason(events: list) -> str | None:
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) and "choices" in e
               for c in e["choices"] if c.get("finish_reason")]
    return reasons[-1] if reasons else None


def test_ready_is_503_while_loading_then_200():
    srv = server("smollm")  # /ready was polled every 0.1 s from the process's start
    history = [s for s in srv.ready_history if s is not None]  # None: not listening yet
    assert 503 in history and history[-1] == 200
    assert history.index(200) > history.index(503)
    assert requests.get(srv.url + "/health").status_code == 200
    assert requests.get(srv.url + "/ready").json()["status"] == "ready"


def test_queue_limit_answers_503_with_retry_after():
    srv = server("queue")  # --max-num-seqs 1 --max-queue-len 1
    running = Stream(srv, SLOW + "a b c", LONG)
    assert running.status_code == 200
    assert running.next_event()  # it is running
    waiting = Stream(srv, SLOW + "d e f", LONG)  # admitted (headers sent): it is in the queue
    assert waiting.status_code == 200
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "g", "max_tokens": 2})
    assert r.status_code == 503
    assert r.headers["Retry-After"].isdigit()
    assert r.json()["error"]["code"] == "queue_full"
    running.close()
    waiting.close()
    deadline = time.monotonic() + 30  # (bounds a hang; no speed is assumed)
    while True:  # the queue drains once those two are aborted
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "g", "max_tokens": 2})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_sigterm_drains_running_requests_and_exits_0():
    # --shutdown-timeout 3: `short` (20 tokens, already streaming) has ample time; `long` is
    # slow by construction (>= 50 s) so it can only end by the drain's abort.
    srv = server("queue")
    short = Stream(srv, "h i j", 20)
    assert short.next_event()
    long = Stream(srv, SLOW + "k l m", LONG)  # waits behind `short`; cannot finish in 3 s
    assert short.status_code == long.status_code == 200
    readers = [threading.Thread(target=s.read_all) for s in (short, long)]
    for t in readers:
        t.start()
    t0 = time.monotonic()
    srv.signal(signal.SIGTERM)
    # draining: not ready, and new requests are refused (or the port is already closed)
    try:
        deadline = time.monotonic() + 20  # until the signal has been handled
        while requests.get(srv.url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
            time.sleep(0.05)
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    except requests.ConnectionError:
        pass
    assert srv.wait_exit(timeout=30) == 0
    for t in readers:
        t.join(10)
    assert _finish_reason(short.events) == "length"  # it finished in the grace period
    assert _finish_reason(long.events) == "abort"    # the rest were aborted at its end
    assert long.events[-1] == "[DONE]"
    assert time.monotonic() - t0 >= 2.5


def test_a_request_failing_in_the_engine_fails_alone():
    srv = server("fault")  # "__poison__" requests get detokenizers that raise
    other = Stream(srv, "q r s", 30)
    assert other.next_event()
    r = requests.post(srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "__poison__", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "injected detokenizer surprise" in r.json()["error"]["message"]
    poisoned = Stream(srv, "__poison__", 5)
    assert any("error" in e for e in poisoned.read_all() if isinstance(e, dict))
    assert _finish_reason(other.read_all()) == "length"  # the other request went on
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "t u", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert requests.get(srv.url + "/health").status_code == 200


def test_engine_loop_death_fails_every_client_and_exits_nonzero():
    srv = server("fault")  # its engine raises in step() once "__die__" is added
    victim = Stream(srv, SLOW + "n o p", LONG)
    assert victim.status_code == 200
    assert victim.next_event()
    reader = threading.Thread(target=victim.read_all)
    reader.start()
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "__die__", "max_tokens": 5},
                      timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    health = requests.get(srv.url + "/health", timeout=5)
    assert health.status_code == 503 and "injected fault" in health.json()["error"]
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 5},
                      timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    reader.join(10)
    errors = [e for e in victim.events if isinstance(e, dict) and "error" in e]
    assert errors and "injected fault" in errors[0]["error"]["message"]
    assert srv.wait_exit(timeout=30) == 1
