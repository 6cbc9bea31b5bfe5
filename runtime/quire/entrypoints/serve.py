"""`quire serve [MODEL]`: the OpenAI-compatible server under uvicorn.

The port opens at once and the model loads in the background (/ready says when it is done).
SIGTERM (or Ctrl-C) drains: no new requests, admitted ones get --shutdown-timeout seconds to
finish, the rest are aborted, and the process exits 0. A second signal exits at once. If the
model fails to load or the engine loop dies, the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvicorn

from quire.config import EngineArgs
from quire.entrypoints.cli import add_engine_flags, engine_args_from
from quire.metrics import COMPAT_CHOICES

logger = logging.getLogger(__name__)

API_KEY_ENV = "QUIRE_API_KEY"
FATAL_EXIT_DELAY = 1.0  # seconds /health answers 503 (and clients get their errors) before exit


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None,
                   help=EngineArgs.__dataclass_fields__["model"].metadata["help"])
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the model's own name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on the API (default: "
                        f"${API_KEY_ENV}); /health, /ready, /metrics stay open")
    p.add_argument("--max-queue-len", type=_positive, default=None,
                   help="waiting requests beyond which new ones get 503 + Retry-After "
                        "(default: unbounded)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--log-requests", action="store_true",
                   help="log every request (prompt, parameters, tokens) and the access log")
    p.add_argument("--metrics-compat", choices=COMPAT_CHOICES, default="none",
                   help="also export the metrics under vLLM's names")
    add_engine_flags(p)
    p.set_defaults(func=cmd_serve)
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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


def cmd_serve(ns: argparse.Namespace) -> int:
    from quire.engine.async_engine import AsyncLLMEngine
    from quire.entrypoints.api_server import build_app
    from quire.metrics import ServerMetrics

    args = engine_args_from(ns, ns.model)
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    metrics = ServerMetrics(ns.metrics_compat)
    engine = AsyncLLMEngine(args, served_model_name=ns.served_model_name,
                            max_queue_len=ns.max_queue_len, stats=metrics)
    app = build_app(engine, metrics, api_key=api_key, log_requests=ns.log_requests)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                            access_log=ns.log_requests, timeout_graceful_shutdown=5,
                            lifespan="on", log_config=None)
    server = QuireServer(config, engine, ns.shutdown_timeout)
    logger.info("quire serve: model %s, http://%s:%d (API key %s)",
                args.model or "(default)", ns.host, ns.port, "on" if api_key else "off")
    server.run()
    if server.exit_code:
        logger.error("exiting with status %d: %s", server.exit_code, engine.fatal_error)
    if engine.busy:  # a load or step still running in the worker: don't wait for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code
