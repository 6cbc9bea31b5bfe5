"""Pieces of the server that need no live server: the tokenizer pool's bounded queue, the
budgets of a request's own chat template, and `quire serve` without its dependencies."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from quire.entrypoints import request_chat_template
from quire.entrypoints.cli import main
from quire.entrypoints.errors import OpenAIError
from quire.entrypoints.tokenizer_pool import TokenizerPool

CONVERSATION = [{"role": "user", "content": "hi"}]


def test_tokenizer_pool_refuses_work_past_its_queue():
    release = threading.Event()

    def blocked(tokenizer):
        release.wait(30)
        return "done"

    async def main_():
        pool = TokenizerPool(tokenizer=object(), size=1, queue=1)
        first = asyncio.ensure_future(pool.run(blocked))
        second = asyncio.ensure_future(pool.run(blocked))
        await asyncio.sleep(0)
        with pytest.raises(OpenAIError) as e:
            await pool.run(blocked)
        assert e.value.status == 503 and e.value.code == "server_busy"
        release.set()
        assert await first == await second == "done"
        assert pool.in_flight == 0
        pool.shutdown()
    asyncio.run(main_())


@pytest.mark.parametrize("template, reason", [
    ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
     "time budget"),
    ("{{ 'x' * 10**9 }}", "size budget"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "size budget"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}"
     "{% set ns.s = ns.s|replace('x', ns.s) %}{% endfor %}", "size budget"),
    ("{{ 'x'.ljust(10**9) }}", "size budget"),
    ("{{ '%999999999d' % 1 }}", "not allowed"),
    ("{{ '{:999999999}'.format(1) }}", "not allowed"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% for x in %}", "failed"),
])
def test_request_chat_template_budgets(template, reason):
    with pytest.raises(OpenAIError) as e:
        request_chat_template.render(template, CONVERSATION, True, {}, timeout=0.5,
                                     max_chars=100_000)
    assert e.value.status == 400 and e.value.param == "chat_template"
    assert reason in e.value.message


def test_request_chat_template_renders():
    text = request_chat_template.render(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content|upper }}{% endfor %}"
        "{% if add_generation_prompt %}|{% endif %}", CONVERSATION, True, {"bos_token": "<s>"},
        timeout=5, max_chars=1000)
    assert text == "<s>user: HI|"


def test_serve_without_its_dependencies_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "quire serve needs the Python package 'uvicorn'" in err
    with pytest.raises(SystemExit):  # and the subcommand is still listed
        main(["--help"])
    assert "serve" in capsys.readouterr().out


def test_connection_limit_flags_reach_uvicorn():
    from quire.entrypoints.cli import build_parser
    from quire.entrypoints.limits import limits_from
    from quire.entrypoints.uvicorn_server import uvicorn_config

    ns = build_parser().parse_args([
        "serve", "--limit-concurrency", "7", "--timeout-keep-alive", "3",
        "--max-header-bytes", "4K", "--timeout-header", "4", "--max-request-body-bytes", "2M"])
    limits = limits_from(ns)
    assert limits.max_request_body_bytes == 2 << 20 and limits.timeout_header == 4
    config = uvicorn_config(object(), "127.0.0.1", 0, "info", False, limits)
    assert config.limit_concurrency == 7
    assert config.timeout_keep_alive == 3
    assert config.h11_max_incomplete_event_size == 4096
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-stop-strings", "0"])  # must be > 0


def test_heap_is_trimmed_once_loaded_and_after_each_burst_when_idle(monkeypatch):
    """A checkpoint quantized on load leaves its float tensors' pages free in malloc's heap:
    the server trims once the model is loaded, then after requests once nothing is in flight
    (never while a request runs, never twice for one burst)."""
    from types import SimpleNamespace

    from quire.entrypoints import memory
    trims = []
    monkeypatch.setattr(memory, "trim", lambda: trims.append(engine.num_requests_added) or True)
    engine = SimpleNamespace(loaded=asyncio.Event(), num_requests_added=0, idle=True)

    async def settled(want: list[int]) -> list[int]:
        """trims once it equals `want` (waiting up to 10 s: a slow machine may take its time),
        after a few more intervals in which a wrong extra trim could show up."""
        for _ in range(1000):
            if trims == want:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return trims

    async def main_():
        task = asyncio.create_task(memory.trim_when_idle(engine, interval=0.01))
        await asyncio.sleep(0.05)
        assert trims == []                       # still loading
        engine.loaded.set()
        assert await settled([0]) == [0]         # once loaded, not again while nothing came
        engine.num_requests_added, engine.idle = 3, False
        await asyncio.sleep(0.05)
        assert trims == [0]                      # requests in flight
        engine.idle = True
        assert await settled([0, 3]) == [0, 3]   # the burst is over: one trim
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main_())


def test_the_servers_connections_send_without_waiting_for_acks():
    """`quire serve` binds its own socket; asyncio sets TCP_NODELAY only on connections whose
    listening socket names IPPROTO_TCP. Without it a kept-alive connection's response
    (headers and body written apart) waited on the client's delayed ACK, 40 ms a request."""
    import asyncio
    import socket

    from quire.entrypoints.serve import listening_socket
    sock = listening_socket("127.0.0.1", 0)
    seen = []

    async def main():
        async def accepted(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                   socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0
