"""The router as a Gateway's endpoint picker: `--ext-proc-port` speaks Envoy's ext_proc to a
client that plays the gateway (gateway_client.py), over two live fake replicas."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

import pytest
import requests
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from quire.router.cli import add_router_arguments, build_state
from quire.router.endpoint_picking import EndpointPicker
from quire.router.ext_proc_conversation import Conversation

from gateway_client import BUFFERED, FULL_DUPLEX, STREAMED, request_headers, route
from router_harness import (
    ROOT,
    InProcessRouter,
    fake_backend,
    free_port,
    reset_fakes,
    router,
    router_state,
    running_fakes,
    server_harness,
    wait_until,
)

HOST = "127.0.0.50"


@pytest.fixture(scope="module")
def fakes():
    with running_fakes("ab", 51) as procs:
        yield procs


@pytest.fixture
def replicas(fakes):
    return reset_fakes(fakes)


def endpoint(proc) -> str:
    return proc.url.split("://", 1)[1]


def picker(*args: str, backends=()) -> InProcessRouter:
    """The router as `quire router` builds it (flags -> state -> services -> app), in-process."""
    return InProcessRouter("--ext-proc-port", str(free_port(HOST)), *args,
                           *[f"--backend={b.url}" for b in backends], host=HOST)


def target(r: InProcessRouter) -> str:
    return f"{HOST}:{r.ns.ext_proc_port}"


def completion(prompt: str, **extra) -> bytes:
    return json.dumps({"model": "fake", "prompt": prompt, "max_tokens": 2, **extra}).encode()


@pytest.mark.parametrize("mode, announce", [(BUFFERED, True), (STREAMED, True),
                                            (FULL_DUPLEX, True), (FULL_DUPLEX, False)])
def test_each_request_gets_a_live_replica_as_its_destination_in_every_body_mode(replicas, mode,
                                                                                announce):
    """`announce`: Envoy names its modes in the first message; unnamed, GIE's are assumed."""
    a, b = replicas["a"], replicas["b"]
    names = {endpoint(a): "a", endpoint(b): "b"}
    body = completion("Tell me about the sea. " * 40)
    with picker("--routing", "least-load", backends=[a, b]) as r:
        async def requests_through_the_gateway():
            return [await route(target(r), "/v1/completions", body, mode=mode, chunks=5,
                                announce=announce, response_body=b'{"choices": []}')
                    for _ in range(4)]

        routed = asyncio.run(requests_through_the_gateway())
        for x in routed:
            assert x.status is None
            assert x.destination in names
            # Buffered: Envoy holds the headers until the body is answered, so the body's
            # answer routes; streamed: the headers' answer, held until the last chunk came.
            assert x.destination_phase == ("request_body" if mode == BUFFERED
                                           else "request_headers")
            # The answer's way back passes through unchanged.
            assert [a.WhichOneof("response") for a in x.response_answers] == \
                ["response_headers", "response_body"]
            assert not x.response_answers[0].response_headers.response.HasField("header_mutation")
            if mode == FULL_DUPLEX:  # Envoy keeps no copy in this mode: the picker sends it on
                assert x.forwarded_body == body
                assert x.response_answers[1].response_body.response.body_mutation \
                    .streamed_response.body == b'{"choices": []}'
        # Equal replicas share the requests (least-load ties go round-robin).
        assert {names[x.destination] for x in routed} == {"a", "b"}
        # The gateway then sends the request there: a live replica answers it.
        for x in routed[:2]:
            answer = requests.post(f"http://{x.destination}/v1/completions", data=body,
                                   headers={"content-type": "application/json"}, timeout=30)
            assert answer.json()["backend"] == names[x.destination]
        # Counted like the HTTP mode's requests (the operator's idle signal reads these).
        metrics = requests.get(r.url + "/metrics", timeout=5).text
        assert "quire_router:requests_total 4.0" in metrics
        assert 'quire_router:routing_decisions_total{policy="least-load",reason="least_load"} 4.0' \
            in metrics


def test_load_and_the_gateways_endpoint_subset_decide(replicas):
    a, b = replicas["a"], replicas["b"]
    with picker("--routing", "least-load", backends=[a, b]) as r:
        requests.post(a.url + "/control", json={"waiting": 50, "kv": 0.9}, timeout=5)
        wait_until(lambda: any(x["waiting"] == 50 for x in router_state(r)["backends"]), 30,
                   "the router to scrape a's queue")

        async def gateway():
            by_load = [await route(target(r), "/v1/completions", completion(f"q{i}"))
                       for i in range(4)]
            # A GET without a body (the gateway's /v1/models) is routed on its headers.
            models = await route(target(r), "/v1/models", None)
            # The gateway's subset hint (GIE): only those endpoints, loaded or not.
            only_a = [await route(target(r), "/v1/completions", completion(f"s{i}"),
                                  subset=[endpoint(a)]) for i in range(3)]
            outside = await route(target(r), "/v1/completions", completion("x"),
                                  subset=["10.9.9.9:8000"])
            # A buffered body comes as one message, here larger than gRPC's default limit.
            large = await route(target(r), "/v1/completions", completion("y" * (6 << 20)),
                                mode=BUFFERED)
            return by_load + [large], models, only_a, outside

        by_load, models, only_a, outside = asyncio.run(gateway())
        assert [x.destination for x in by_load] == [endpoint(b)] * 5
        assert models.destination == endpoint(b) and models.destination_phase == "request_headers"
        assert [x.destination for x in only_a] == [endpoint(a)] * 3
        assert outside.status == 503
        assert outside.error["code"] == "subset_unavailable"
        assert "10.9.9.9:8000" in outside.error["message"]


@pytest.fixture(scope="module")
def tokenizer_model():
    return server_harness().tiny_model()


def test_a_repeated_long_prefix_lands_on_the_same_replica_in_both_modes(tokenizer_model,
                                                                        replicas):
    a, b = replicas["a"], replicas["b"]
    names = {endpoint(a): "a", endpoint(b): "b"}
    conversations = {u: [{"role": "system", "content": f"Assistant of user {u}. "
                                                       + "You answer briefly and kindly. " * 8}]
                     for u in range(3)}  # 3 users on 2 replicas: round-robin would wander
    seen = {u: [] for u in conversations}
    with picker("--routing", "prefix-aware", "--model", tokenizer_model,
                backends=[a, b]) as r:
        async def turns():
            for turn in range(3):
                for user, messages in conversations.items():
                    messages.append({"role": "user", "content": f"user {user}, question {turn}: "
                                                                + "tell me more " * 6})
                    body = json.dumps({"model": "fake", "messages": messages}).encode()
                    routed = await route(target(r), "/v1/chat/completions", body,
                                         mode=FULL_DUPLEX, chunks=3)
                    seen[user].append(names[routed.destination])
                    messages.append({"role": "assistant", "content": "Sure."})

        asyncio.run(turns())
        assert all(len(set(s)) == 1 for s in seen.values()), seen  # each user sticks
        assert {s[0] for s in seen.values()} == {"a", "b"}  # and users spread
        # One prefix index for both modes: the next turn through the router's own HTTP port
        # goes where the picker sent the conversation.
        messages = conversations[0] + [{"role": "user", "content": "and finally?"}]
        answer = requests.post(r.url + "/v1/chat/completions", timeout=60,
                               json={"model": "fake", "messages": messages, "stream": False,
                                     "max_tokens": 2})
        assert answer.json()["backend"] == seen[0][0]


@pytest.mark.parametrize("path, body, complaint", [
    ("/v1/completions", b'{"prompt": "hi", "model": "fake"', "not valid JSON"),
    ("/v1/completions", b'["hi"]', "must be a JSON object, not a list"),
    ("/v1/completions", b'', "the request body is empty"),
    ("/v1/completions", b'{"model": "fake", "prompt": 7}', "prompt: required"),
    ("/v1/completions", b'{"model": 3, "prompt": "hi"}', "model: must be a non-empty string"),
    ("/v1/chat/completions", b'{"model": "fake", "prompt": "hi"}', "messages: required"),
    ("/v1/chat/completions", b'{"messages": ["hi"]}', "messages[0]: must be an object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"cache_salt": 5}', "cache_salt: must be a non-empty string"),
])
def test_a_body_the_picker_cannot_read_gets_a_400_naming_what_is_wrong(replicas, path, body,
                                                                      complaint):
    with picker(backends=[replicas["a"]]) as r:
        async def both_modes():
            return [await route(target(r), path, body, mode=mode, chunks=2)
                    for mode in (BUFFERED, FULL_DUPLEX)]

        for routed in asyncio.run(both_modes()):
            assert routed.status == 400
            assert routed.error["code"] == "bad_request"
            assert complaint in routed.error["message"], routed.error
            assert routed.error["headers"]["content-type"] == "application/json"


def test_quire_router_holds_then_answers_503_without_replicas_and_refuses_a_taken_port(replicas):
    """`python -m quire.router --ext-proc-port` itself, started as a process."""
    a = replicas["a"]
    ext_port = free_port(HOST)
    with router("--admin-api", "--max-pending", "1", "--hold-timeout", "60",
                "--retry-after", "7", "--ext-proc-port", str(ext_port), host=HOST) as r:
        async def gateway():
            held = asyncio.ensure_future(route(f"{HOST}:{ext_port}", "/v1/completions",
                                               completion("wait for me"), mode=BUFFERED))
            await asyncio.to_thread(wait_until, lambda: router_state(r)["pending_requests"] == 1,
                                    30, "the request to be held")
            # The hold is the HTTP mode's own: it is full, so no replica means a 503 now.
            full = await route(f"{HOST}:{ext_port}", "/v1/completions", completion("no room"))
            await asyncio.to_thread(requests.post, r.url + "/router/backends",
                                    json={"url": a.url}, timeout=5)
            return full, await asyncio.wait_for(held, 60)

        full, held = asyncio.run(gateway())
        assert full.status == 503
        assert full.error["code"] == "queue_full"
        assert full.error["headers"]["retry-after"] == "7"
        assert held.destination == endpoint(a)  # the replica that appeared
    # A port another process holds stops the start, and says which.
    taken = fake_backend("squatter", HOST)
    with taken:
        port = taken.url.rsplit(":", 1)[1]
        done = subprocess.run([sys.executable, "-m", "quire.router", "--host", HOST, "--port",
                               str(free_port(HOST)), "--ext-proc-port", port],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert f"--ext-proc-port: cannot listen on {HOST}:{port}" in done.stderr, done.stderr[-2000:]


def test_the_body_modes_edges_stream_by_stream():
    """STREAMED without send_body_without_waiting_for_header_response: Envoy wants the headers
    answered before any chunk, so load decides then. BUFFERED_PARTIAL: the one body message
    may be the start of a larger body, cut mid-JSON: load decides, no 400. Trailers end a
    held body whose last chunk did not."""
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    state, _ = build_state(parser.parse_args(["--backend", "http://10.1.2.3:8000"]))

    def first(mode: str) -> pb.ProcessingRequest:
        return pb.ProcessingRequest(
            request_headers=request_headers("/v1/completions", "POST", False),
            protocol_config=pb.ProtocolConfiguration(
                request_body_mode=ProcessingMode.BodySendMode.Value(mode)))

    def chunk(data: bytes, end: bool) -> pb.ProcessingRequest:
        return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))

    def destination(answer: pb.ProcessingResponse) -> str:
        phase = answer.WhichOneof("response")
        return getattr(answer, phase).response.header_mutation.set_headers[0].header.raw_value

    async def conversations():
        streamed = Conversation(EndpointPicker(state), retry_after=5)
        on_headers = await streamed.answer(first("STREAMED"))
        on_chunks = [await streamed.answer(chunk(b'{"prompt": "hi"', False)),
                     await streamed.answer(chunk(b', "model": "m"}', True))]
        partial = Conversation(EndpointPicker(state), retry_after=5)
        partial_headers = await partial.answer(first("BUFFERED_PARTIAL"))
        partial_body = await partial.answer(chunk(b'{"prompt": "a very long prom', False))
        whole = Conversation(EndpointPicker(state), retry_after=5)
        await whole.answer(first("BUFFERED_PARTIAL"))
        refused = await whole.answer(chunk(b'{"prompt": ', True))
        trailing = Conversation(EndpointPicker(state), retry_after=5)
        await trailing.answer(first("FULL_DUPLEX_STREAMED"))
        held = await trailing.answer(chunk(b'{"prompt": "hi"}', False))
        on_trailers = await trailing.answer(pb.ProcessingRequest(
            request_trailers=pb.HttpTrailers()))
        for c in (streamed, partial, whole, trailing):
            c.close()
        await state.client.aclose()
        return on_headers, on_chunks, partial_headers, partial_body, refused, held, on_trailers

    on_headers, on_chunks, partial_headers, partial_body, refused, held, on_trailers = \
        asyncio.run(conversations())
    assert [a.WhichOneof("response") for a in on_headers] == ["request_headers"]
    assert destination(on_headers[0]) == b"10.1.2.3:8000"
    assert [[a.request_body for a in answers] for answers in on_chunks] == \
        [[pb.BodyResponse()], [pb.BodyResponse()]]  # each chunk: CONTINUE
    assert partial_headers == [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
    assert destination(partial_body[0]) == b"10.1.2.3:8000"
    assert refused[0].immediate_response.status.code == 400  # whole, and not JSON
    assert held == []
    assert [a.WhichOneof("response") for a in on_trailers] == \
        ["request_headers", "request_body", "request_trailers"]
    assert destination(on_trailers[0]) == b"10.1.2.3:8000"
    streamed_on = on_trailers[1].request_body.response.body_mutation.streamed_response
    assert (streamed_on.body, streamed_on.end_of_stream) == (b'{"prompt": "hi"}', False)
    assert state.backends.all()[0].in_flight == 0  # every pick released with its conversation
