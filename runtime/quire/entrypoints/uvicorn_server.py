"""uvicorn, as `quire serve` runs it: a drain on SIGTERM, an exit code, HTTPS when asked
(tls.py), and the connection limits (header timeout, keep-alive, header size, concurrency)
that slow or hostile clients meet before any request reaches the app."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from quire.entrypoints.limits import ServerLimits
from quire.entrypoints.tls import ServerTLS

logger = logging.getLogger(__name__)

FATAL_EXIT_DELAY = 1.0  # seconds /health answers 503 (and clients get their errors) before exit
GRACEFUL_SHUTDOWN_TIMEOUT = 5  # seconds uvicorn waits for open connections after the drain


def uvicorn_config(app, host: str, port: int, log_level: str, access_log: bool,
                   limits: ServerLimits, tls: ServerTLS | None = None) -> uvicorn.Config:
    tls = tls or ServerTLS()
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT, lifespan="on", log_config=None,
        http=guarded_h11_protocol(limits.timeout_header, limits.max_header_bytes),
        timeout_keep_alive=limits.timeout_keep_alive,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        limit_concurrency=limits.limit_concurrency, **tls.uvicorn_kwargs())


def guarded_h11_protocol(seconds: float, max_header_bytes: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that do not finish a request's headers
    within `seconds` of opening (or of the previous response), and answering 431 to a request
    line plus headers longer than `max_header_bytes`. uvicorn itself only times out idle
    keep-alive connections (a client that trickles one header byte at a time resets even
    that: slowloris), and h11's size limit only applies to headers that arrive in pieces."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head = b""  # what has come of the headers being waited for

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:  # waiting for a request's headers
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if end > max_header_bytes or (end < 0 and len(self._head) > max_header_bytes):
                    self._refuse_headers()
                    return
                if end >= 0:
                    self._head = b""
            super().data_received(data)

        def _refuse_headers(self) -> None:
            self._disarm()
            body = json.dumps({"error": {
                "message": f"the request line and headers are longer than {max_header_bytes} "
                           f"bytes (--max-header-bytes)", "type": "invalid_request_error",
                "param": None, "code": "headers_too_large"}}).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before the base class starts a pipelined request (which disarms)
            super().on_response_complete()
            if self.transport.is_closing():
                self._disarm()

        def _arm(self) -> None:
            self._disarm()
            self._head = b""
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                logger.debug("closing a connection that sent no complete request headers "
                             "in %gs (--timeout-header)", seconds)
                self.transport.close()

    return GuardedH11Protocol


class QuireServer(uvicorn.Server):
    """uvicorn, with a drain on SIGTERM/SIGINT instead of an immediate stop, and an exit
    code: 0 after a drain, 1 if the engine failed."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.on_fatal = self._on_fatal

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # runs in the signal handler
        if self._draining or self.should_exit:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        logger.info("%s: draining (up to %.0fs)", signal.Signals(sig).name,
                    self.shutdown_timeout)
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.engine.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True

    def _on_fatal(self, error: BaseException) -> None:
        self.exit_code = 1
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_later(FATAL_EXIT_DELAY, setattr, self, "should_exit", True)
