"""Hostile clients against a live `quire serve` (the tiny server: --max-request-body-bytes 1M,
--request-body-timeout 2, --timeout-header 2, --timeout-keep-alive 2, --max-header-bytes
8192, request chat templates allowed within --chat-template-timeout 2).

For every hostile input: the right 4xx naming the field; /health keeps answering fast while
the hostile request is in flight; another client's stream keeps producing tokens; no ERROR
line or traceback in the server's log (fault_launcher.py also logs an ERROR if a string
prompt ever reaches the engine thread); every KV block free afterwards.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import pytest
import requests

from server_harness import metric, metrics_of, server, wait_idle

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
SLOW = "__slow__ "  # fault_launcher.py: >= 50 ms a token on any machine
HEALTH_BOUND = 0.2  # seconds: the median /health answer while a hostile request is in flight
# A template that loops until its time budget (2 s) stops it: on the event loop it would hold
# /health for those 2 s.
SPIN_TEMPLATE = ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}"
                 "{% endfor %}")


@pytest.fixture(scope="module")
def srv():
    return server("tiny")


class HealthProbe(threading.Thread):
    """GETs /health back to back (on a fresh connection each time) and keeps the latencies."""

    def __init__(self, srv) -> None:
        super().__init__(daemon=True)
        self.srv, self.stop, self.latencies = srv, threading.Event(), []
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                r = requests.get(self.srv.url + "/health", timeout=30)
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:100]}")
            except requests.RequestException as e:
                self.failures.append(repr(e))
            self.latencies.append(time.perf_counter() - t0)
            self.stop.wait(0.02)


class OtherClient(threading.Thread):
    """Another client's long stream, counting the events it receives."""

    def __init__(self, srv) -> None:
        super().__init__(daemon=True)
        body = {"prompt": SLOW + "an innocent bystander", "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        self.resp = requests.post(srv.url + C, json=body, headers=srv.headers, stream=True,
                                  timeout=60)
        assert self.resp.status_code == 200
        self.events = 0
        self.first = threading.Event()

    def run(self) -> None:
        try:
            for line in self.resp.iter_lines():
                if line.startswith(b"data: "):
                    self.events += 1
                    self.first.set()
        except (requests.RequestException, AttributeError):
            pass  # closed by the test

    def wait_for_more_than(self, n: int, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.events <= n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.events > n


class Watched:
    """`with Watched(srv) as w:` runs a hostile request with another client streaming and
    /health probed; on exit asserts the bystander kept getting tokens, no ERROR was logged,
    and every KV block came back."""

    def __init__(self, srv, probe_health: bool = True) -> None:
        self.srv, self.probe_health = srv, probe_health

    def __enter__(self) -> Watched:
        self.log_start = len(self.srv.log_lines())
        self.other = OtherClient(self.srv)
        self.other.start()
        assert self.other.first.wait(60)
        self.probe = HealthProbe(self.srv)
        if self.probe_health:
            self.probe.start()
        self.events_before = self.other.events
        return self

    def health_latencies(self) -> list[float]:
        """Stop probing; the latencies seen while the hostile request was in flight (the
        median must be under HEALTH_BOUND: one slow answer on a loaded machine is noise, a
        blocked event loop delays them all)."""
        if not self.probe.stop.is_set():
            self.probe.stop.set()
            self.probe.join(30)
            assert self.probe.failures == [], self.probe.failures
            if self.probe.latencies:
                median = statistics.median(self.probe.latencies)
                assert median < HEALTH_BOUND, self.probe.latencies
        return self.probe.latencies

    def __exit__(self, *exc) -> None:
        if self.probe_health and exc[0] is None:
            self.health_latencies()
        self.probe.stop.set()
        if exc[0] is None:
            assert self.other.wait_for_more_than(self.events_before), "the other stream stalled"
        self.other.resp.close()
        samples = wait_idle(self.srv)
        if exc[0] is None:
            assert metric(samples, "quire:kv_cache_blocks_used") == 0
            assert metric(samples, "quire:num_requests_running") == 0
            assert self.srv.error_lines(self.log_start) == []


def _error(r: requests.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}
    return err["message"]


def _raw(srv, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    s.sendall(data)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _headers(srv, path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


# --- CPU work off the event loop ------------------------------------------------------------
def test_pathological_chat_template_is_stopped_and_health_stays_fast(srv):
    with Watched(srv) as w:
        t0 = time.monotonic()
        r = requests.post(srv.url + CHAT, headers=srv.headers, timeout=60,
                          json={"messages": MSG, "chat_template": SPIN_TEMPLATE})
        took = time.monotonic() - t0
        latencies = w.health_latencies()
        assert "time budget" in _error(r, 400, "chat_template")
        assert took >= 1.9  # it really ran for its budget, with the probes going
        assert len(latencies) >= 5  # probed all along (median checked in health_latencies)


def test_request_chat_template_renders_when_allowed(srv):
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    r = requests.post(srv.url + CHAT, headers=srv.headers, timeout=60,
                      json={"messages": MSG, "chat_template": template, "max_tokens": 3})
    assert r.status_code == 200, r.text
    tokens = requests.post(srv.url + "/tokenize", headers=srv.headers,
                           json={"prompt": "[user] hi\n[assistant] ",
                                 "add_special_tokens": False}).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] == tokens
    for hostile in ("{{ ''.__class__.__mro__ }}", "{{ 'x' * 10**9 }}",
                    "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"):
        r = requests.post(srv.url + CHAT, headers=srv.headers, timeout=60,
                          json={"messages": MSG, "chat_template": hostile})
        _error(r, 400, "chat_template")


# --- size before work -----------------------------------------------------------------------
def test_body_over_the_limit_is_refused_before_it_is_read(srv):
    with Watched(srv):
        # 100 MB announced, 1 KB sent: the answer comes without waiting for the rest
        s = _raw(srv, _headers(srv, C, 100 << 20) + b"{" + b" " * 1024)
        head, _, body = _read_until_closed(s).partition(b"\r\n\r\n")
        s.close()
        assert head.startswith(b"HTTP/1.1 413"), head
        assert "--max-request-body-bytes" in json.loads(body)["error"]["message"]


def test_oversized_prompt_is_refused_by_characters_before_tokenizing(srv):
    prompt = "hello " * 150_000  # 900 KB: under the body limit, far over 16 x 1024 chars
    with Watched(srv):
        r = requests.post(srv.url + C, headers=srv.headers, timeout=60,
                          json={"prompt": prompt, "max_tokens": 2})
        assert "--max-prompt-chars" in _error(r, 400, "prompt")
        r = requests.post(srv.url + C, headers=srv.headers, timeout=60,
                          json={"prompt": "hello " * 2000, "max_tokens": 2})  # tokens, then
        assert "1024 tokens" in _error(r, 400, "prompt")


def test_hostile_fields_are_refused_naming_them(srv):
    cases = [
        (C, b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
        (C, json.dumps({"prompt": "hi", "stop": ["x"] * 1000}).encode(), "stop"),
        (CHAT, json.dumps({"messages": [{"role": "root", "content": "hi"}]}).encode(),
         "messages"),
    ]
    with Watched(srv):
        for path, body, param in cases:
            r = requests.post(srv.url + path, data=body, timeout=60,
                              headers={**srv.headers, "Content-Type": "application/json"})
            message = _error(r, 400, param)
            assert param in message


# --- slow clients ---------------------------------------------------------------------------
def test_slow_body_gets_408(srv):
    with Watched(srv):
        s = _raw(srv, _headers(srv, C, 100) + b'{"prompt": ')  # and then nothing
        head, _, body = _read_until_closed(s).partition(b"\r\n\r\n")
        s.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert "--request-body-timeout" in json.loads(body)["error"]["message"]


def test_slowloris_headers_are_cut_off(srv):
    with Watched(srv) as w:
        s = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.5)
        closed = False
        deadline = time.monotonic() + 60  # --timeout-header is 2 s; this only bounds a hang
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"X")  # one byte of a header at a time, forever
                closed = s.recv(1024) == b""
            except TimeoutError:
                continue
            except OSError:  # reset or broken pipe: closed by the server
                closed = True
        s.close()
        assert closed
        assert w.health_latencies()


def test_idle_keep_alive_connections_are_closed(srv):
    s = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(60)  # --timeout-keep-alive is 2 s; this only bounds a hang
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    assert data.startswith(b"HTTP/1.1 200")
    _read_until_closed(s)  # returns once the server closes the idle connection
    s.close()


def test_oversized_headers_are_refused(srv):
    with Watched(srv, probe_health=False):
        s = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000
                 + b"\r\n\r\n")
        head, _, body = _read_until_closed(s).partition(b"\r\n\r\n")
        s.close()
        assert head.startswith(b"HTTP/1.1 431"), head
        assert "--max-header-bytes" in json.loads(body)["error"]["message"]


# --- clients that go away -------------------------------------------------------------------
def test_disconnects_are_silent_aborts_counted_in_metrics(srv):
    before = metric(metrics_of(srv), "quire:client_disconnects_total")
    with Watched(srv):
        for path, body in ((C, {"prompt": SLOW + "bye", "max_tokens": 900, "ignore_eos": True}),
                           (CHAT, {"messages": [{"role": "user", "content": SLOW + "bye"}],
                                   "max_tokens": 900, "ignore_eos": True}),
                           ("/generate", {"prompt": SLOW + "bye", "max_tokens": 900,
                                          "ignore_eos": True})):
            with pytest.raises(requests.exceptions.ReadTimeout):
                requests.post(srv.url + path, json=body, headers=srv.headers, timeout=1.0)
        # and a stream that hangs up after its first event
        r = requests.post(srv.url + CHAT, headers=srv.headers, stream=True, timeout=60,
                          json={"messages": [{"role": "user", "content": SLOW + "bye"}],
                                "max_tokens": 900, "ignore_eos": True, "stream": True})
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        r.close()
        deadline = time.monotonic() + 60
        while metric(metrics_of(srv), "quire:client_disconnects_total") < before + 4:
            assert time.monotonic() < deadline, "disconnects were not counted"
            time.sleep(0.05)
    # (Watched checked: no ERROR line or traceback in the log, every block free)


def test_a_client_that_hangs_up_mid_upload_is_a_quiet_disconnect(srv):
    """The body declared, a part of it sent, the connection closed: counted as a disconnect,
    no traceback and no ERROR line (Watched), on every endpoint that reads a body."""
    before = metric(metrics_of(srv), "quire:client_disconnects_total")
    paths = (C, CHAT, "/generate")
    with Watched(srv):
        for path in paths:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          f"\r\nAuthorization: Bearer {srv.api_key}\r\n"
                          "Content-Length: 4000\r\n\r\n{\"prompt\": \"half".encode())
                time.sleep(0.3)  # the server is inside its read of the body
        deadline = time.monotonic() + 30
        while metric(metrics_of(srv), "quire:client_disconnects_total") < before + len(paths):
            assert time.monotonic() < deadline, "the dropped uploads were not counted"
            time.sleep(0.05)
    assert not [line for line in srv.log_lines()[-200:]
                if "Exception in ASGI application" in line or "unhandled error" in line]
