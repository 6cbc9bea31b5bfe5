"""`quire serve [MODEL]`: the OpenAI-compatible server under uvicorn.

The port opens at once and the model loads in the background (/ready says when it is done).
SIGTERM (or Ctrl-C) drains: no new requests, admitted ones get --shutdown-timeout seconds to
finish, the rest are aborted, and the process exits 0. A second signal exits at once. If the
model fails to load or the engine loop dies, the process exits 1.

This module imports nothing beyond the standard library and the engine flags until the command
runs, so `quire --help` always lists `serve`; a missing server dependency is reported then.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys

from quire.entrypoints.engine_args import add_engine_flags, engine_args_from, model_help
from quire.entrypoints.limits import RESERVED_TEMPLATE_KWARGS, add_limit_flags, limits_from
from quire.entrypoints.reasoning.registry import REASONING_PARSERS
from quire.entrypoints.tls import add_tls_flags, tls_from
from quire.tracing import add_tracing_flag, start_tracing

logger = logging.getLogger(__name__)

API_KEY_ENV = "QUIRE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, honoured the same way
SERVER_PACKAGES = ("fastapi", "uvicorn", "h11", "prometheus_client", "jinja2")
DEFAULT_MALLOC_ARENAS = 2
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "openai")  # tool_calls/registry.py's, not imported


class MissingDependency(RuntimeError):
    """A package `quire serve` needs is not installed."""


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None, help=model_help())
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name clients use (default: the model's own name); more "
                        "names are aliases, as in vLLM: the first is the one responses and "
                        "metrics carry")
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
                   help="log every request (prompt size, parameters, tokens) and the access "
                        "log")
    p.add_argument("--metrics-compat", default="none",
                   help="'vllm': also export the metrics under vLLM's names (default: none; "
                        "vllm:lora_requests_info is exported whenever LoRA is on)")
    p.add_argument("--malloc-arena-max", type=int, default=DEFAULT_MALLOC_ARENAS,
                   help="glibc malloc arenas at most (MALLOC_ARENA_MAX): fewer arenas keep "
                        "the resident set from growing with the thread count; 0 leaves "
                        "glibc's default (8 per core)")
    p.add_argument("--trim-idle-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="return free heap pages to the kernel (malloc_trim) when the server "
                        "goes idle after serving")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=("auto", *TOOL_PARSER_NAMES),
                   help="how tool calls look in the model's text: 'hermes' (<tool_call> "
                        "JSON, Qwen2 / SmolLM2), 'llama3_json' (Llama 3.x), 'openai' "
                        "(gpt-oss's harmony calls, with --reasoning-parser openai_gptoss), "
                        "or 'auto': picked by the model's family (Qwen: hermes, gpt-oss: "
                        "openai) or else read from the chat template")
    p.add_argument("--reasoning-parser", default=None, choices=tuple(REASONING_PARSERS),
                   help="split the answer's <think>...</think> part into the message's "
                        "reasoning_content (delta.reasoning_content when streamed): 'qwen3' "
                        "(honours enable_thinking), 'deepseek_r1', or 'openai_gptoss' "
                        "(gpt-oss's harmony channels: analysis is reasoning, final is "
                        "content, calls to functions are tool_calls) (default: off, all is "
                        "content)")
    p.add_argument("--default-chat-template-kwargs", type=template_kwargs, default=None,
                   metavar="JSON",
                   help="extra chat template variables for every request, as a JSON object "
                        "(e.g. '{\"enable_thinking\": false}'); a request's "
                        "chat_template_kwargs override them key by key")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        f"(needs --enable-lora; also on with {RUNTIME_LORA_ENV}=true); "
                        "without it they answer 404")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's: the tokenizer's configuration and "
                        "chat template, which lm-eval's remote tokenizer reads); without it "
                        "it answers 404")
    p.add_argument("--headless", action="store_true",
                   help="a node other than node 0 of a multi-node group (--nnodes, "
                        "--node-rank >= 1, --master-addr, --master-port): run this node's "
                        "ranks, serve no API")
    add_tls_flags(p)
    add_tracing_flag(p)
    add_limit_flags(p)
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


def template_kwargs(text: str) -> dict:
    """--default-chat-template-kwargs: a JSON object whose keys the server doesn't set
    itself."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
    if reserved:
        raise argparse.ArgumentTypeError(f"{reserved[0]!r} is set by the server itself")
    return value


def runtime_lora_allowed(ns: argparse.Namespace, environ=os.environ) -> bool:
    """--allow-runtime-lora, or vLLM's environment switch; either needs --enable-lora."""
    allowed = ns.allow_runtime_lora or \
        environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
    if allowed and not ns.enable_lora:
        how = "--allow-runtime-lora" if ns.allow_runtime_lora else f"{RUNTIME_LORA_ENV}=true"
        raise ValueError(f"{how} needs --enable-lora")
    return allowed


def served_names(ns: argparse.Namespace) -> list[str]:
    """--served-model-name's names. It takes several, so `serve --served-model-name x MODEL`
    would read MODEL as a name and serve the default model: refused, saying so."""
    names = ns.served_model_name or []
    if ns.model is None and len(names) > 1:
        raise ValueError(f"--served-model-name took {names} and no MODEL was given; put "
                         f"MODEL first: quire serve MODEL --served-model-name NAME [NAME ...]")
    return names


def lora_parents(ns: argparse.Namespace) -> dict[str, str]:
    """The adapters whose --lora-modules JSON gave a base_model_name: their /v1/models
    parent."""
    return {m.name: m.base_model_name for m in (ns.lora_modules or []) if m.base_model_name}


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads (uvicorn binds only after the
    app's start-up, by when the model has been loading for a while); a ValueError, which
    the CLI prints as its one line, if the address can't be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    family, _, proto, _, address = infos[0]
    # the protocol named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # proto is IPPROTO_TCP, and without it a kept-alive connection's response (headers and
    # body written apart) waited on the client's delayed ACK: 40 ms a request
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (--host, --port)"
                         ) from None
    sock.set_inheritable(True)
    return sock


def require_server_packages() -> None:
    for name in SERVER_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise MissingDependency(
                f"quire serve needs the Python package '{name}', which is not installed "
                f"({e}); install it with `pip install {name.replace('_', '-')}` or reinstall "
                f"quire with its dependencies") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    from quire.distributed.headless import check_node_role, run_headless
    args = engine_args_from(ns, ns.model)
    check_node_role(args, ns.headless)
    if ns.headless:
        return run_headless(args)
    require_server_packages()
    from quire.engine.async_engine import AsyncLLMEngine
    from quire.entrypoints import memory
    from quire.entrypoints.api_server import build_app
    from quire.entrypoints.uvicorn_server import QuireServer, uvicorn_config
    from quire.metrics import ServerMetrics, cache_config_labels

    tls = tls_from(ns)  # before the model loads: a bad certificate fails at once
    sock = listening_socket(ns.host, ns.port)  # and a port in use too
    if ns.malloc_arena_max > 0:
        memory.limit_arenas(ns.malloc_arena_max)  # before the server starts its threads
    allow_runtime_lora = runtime_lora_allowed(ns)
    names = served_names(ns)
    limits = limits_from(ns)
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    metrics = ServerMetrics(ns.metrics_compat, cache_config=cache_config_labels(
        args.block_size, args.kv_cache_dtype, args.enable_prefix_caching))
    tracing = start_tracing(ns.otlp_traces_endpoint, "quire")
    engine = AsyncLLMEngine(args, served_model_name=names[0] if names else None,
                            max_queue_len=ns.max_queue_len, stats=metrics, freeze_gc=True)
    app = build_app(engine, metrics, api_key=api_key, log_requests=ns.log_requests,
                    limits=limits, trim_memory=ns.trim_idle_memory,
                    tool_call_parser=ns.tool_call_parser,
                    reasoning_parser=ns.reasoning_parser,
                    default_template_kwargs=ns.default_chat_template_kwargs,
                    allow_runtime_lora=allow_runtime_lora, lora_parents=lora_parents(ns),
                    model_aliases=names[1:],
                    enable_tokenizer_info=ns.enable_tokenizer_info_endpoint,
                    tracer=tracing.tracer if tracing is not None else None)
    config = uvicorn_config(app, ns.host, ns.port, ns.log_level, ns.log_requests, limits, tls)
    server = QuireServer(config, engine, ns.shutdown_timeout)
    logger.info("quire serve: model %s, %s://%s:%d (API key %s, client certificates %s)",
                args.model or "(default)", tls.scheme, ns.host, ns.port,
                "on" if api_key else "off", ("off", "optional", "required")[tls.cert_reqs])
    if args.enable_lora:
        logger.info("LoRA on: %d adapters at start, loading at runtime %s",
                    len(args.lora_modules or {}), "on" if allow_runtime_lora else "off")
    if allow_runtime_lora and not api_key:  # vLLM warns too: any folder on this host
        logger.warning("runtime LoRA loading is on without an API key: any client can make "
                       "the server read any adapter folder it can see")
    server.run(sockets=[sock])
    if tracing is not None:
        tracing.shutdown()
    if server.exit_code:
        logger.error("exiting with status %d: %s", server.exit_code, engine.fatal_error)
    if engine.busy:  # a load or step still running in the worker: don't wait for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code
