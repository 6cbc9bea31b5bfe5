"""`quire router`: flags, and the router under uvicorn.

Backends: `--backend URL` (repeatable) for local use, or `--k8s-service NAME` to watch the
EndpointSlices of the runtime pods' headless Service (in-cluster credentials, or `--kube-api`
for a plain-HTTP API server such as a test's). HTTPS: `--ssl-*` as `quire serve` takes them
for the router's own port; `--backend-scheme https` and `--backend-ca-certs` towards replicas. `quire router` calls `add_router_parser`;
`python -m quire.router` calls `main` and needs nothing from quire's own CLI.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from quire.entrypoints.tls import add_tls_flags, tls_from
from quire.router.flow_control import DEFAULT_KV_USAGE, DEFAULT_QUEUE_DEPTH
from quire.router.objectives import FAIRNESS_HEADER
from quire.router.policies import POLICIES
from quire.tracing import add_tracing_flag, start_tracing

logger = logging.getLogger(__name__)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeatable); static, for local use")
    p.add_argument("--k8s-service", default=None, metavar="NAME",
                   help="watch the EndpointSlices of this headless Service for ready replicas")
    p.add_argument("--k8s-namespace", default=None,
                   help="its namespace (default: the router pod's own)")
    p.add_argument("--kube-api", default=None, metavar="URL",
                   help="the API server (default: in-cluster); given, no credentials are sent")
    p.add_argument("--backend-port-name", default="http",
                   help="the EndpointSlice port to use (default: http; else the first port)")
    p.add_argument("--backend-scheme", choices=("http", "https"), default="http",
                   help="the scheme of replicas found through --k8s-service, and of --backend "
                        "URLs written without one (default: http)")
    p.add_argument("--backend-ca-certs", default=None, metavar="FILE",
                   help="verify https:// replicas against these CA certificates (PEM) only "
                        "(default: the public CAs)")
    p.add_argument("--backend-check-hostname", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="check that a replica's certificate names its address; "
                        "--no-backend-check-hostname (needs --backend-ca-certs) trusts any "
                        "certificate from that CA, e.g. for pod IPs")
    p.add_argument("--routing", choices=POLICIES, default="least-load")
    p.add_argument("--model", default=None,
                   help="prefix-aware: the model whose tokenizer to use (a GGUF file, folder or "
                        "Hub id; default: the runtime's default model)")
    p.add_argument("--tokenizer", default=None, help="prefix-aware: a tokenizer to use instead")
    p.add_argument("--block-size", type=int, default=16,
                   help="prefix-aware: the replicas' KV block size (tokens)")
    p.add_argument("--prefix-cache-entries", type=int, default=200_000,
                   help="prefix-aware: block hashes remembered (LRU)")
    p.add_argument("--prefix-load-factor", type=float, default=1.0,
                   help="prefix-aware: a replica is overloaded above (1 + this) x the mean "
                        "load plus --prefix-load-slack; then least-load decides")
    p.add_argument("--prefix-load-slack", type=float, default=4.0)
    p.add_argument("--kv-events-bind", default=None, metavar="ENDPOINT",
                   help="precise-prefix: the ZMQ endpoint the router binds for the replicas' "
                        "KV-cache events (e.g. tcp://*:5557); each replica connects with "
                        "--kv-events-config topic kv@<its host:port>@<model>")
    p.add_argument("--kv-events-max-blocks", type=int, default=1_000_000,
                   help="precise-prefix: block hashes the events index keeps at most")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between reads of each replica's /metrics")
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests held while no replica is ready; beyond, 503 + Retry-After")
    p.add_argument("--hold-timeout", type=float, default=300.0,
                   help="seconds a held request waits for a replica before a 503")
    p.add_argument("--retry-after", type=int, default=5,
                   help="the Retry-After (seconds) of the router's own 503s")
    p.add_argument("--max-retries", type=int, default=2,
                   help="other replicas tried when one fails before its first byte")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    # flow control and priorities (flow_control.py, objectives.py)
    p.add_argument("--flow-control", action=argparse.BooleanOptionalAction, default=True,
                   help="while every replica is saturated, hold requests in the router by "
                        "priority and tenant; shed sheddable ones (priority < 0) with 429")
    p.add_argument("--saturation-queue-depth", type=float, default=DEFAULT_QUEUE_DEPTH,
                   help="a replica with this many waiting requests is saturated (GIE's "
                        "default: 5)")
    p.add_argument("--saturation-kv-usage", type=float, default=DEFAULT_KV_USAGE,
                   help="... or with its KV cache this full (GIE's default: 0.8)")
    p.add_argument("--flow-max-wait", type=float, default=60.0,
                   help="seconds a request waits for a replica with room before a 503")
    p.add_argument("--flow-max-queued", type=int, default=1024,
                   help="requests waiting at most; beyond, 503 at once")
    p.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                   help="an InferenceObjective's priority (GIE's: higher first, < 0 "
                        "sheddable), for requests whose x-gateway-inference-objective header "
                        "names it (repeatable)")
    p.add_argument("--watch-objectives", action="store_true",
                   help="with --k8s-service: also watch the InferenceObjectives "
                        "(inference.networking.x-k8s.io/v1alpha2) of the namespace")
    p.add_argument("--inference-pool", default=None, metavar="NAME",
                   help="with --watch-objectives: only objectives whose poolRef names it")
    p.add_argument("--tenant-header", default=FAIRNESS_HEADER,
                   help="the header whose value is a request's tenant for fair waiting "
                        "(default GIE's x-gateway-inference-fairness-id; else the API key)")
    # request migration (migration.py)
    p.add_argument("--migration-limit", type=int, default=3, metavar="N",
                   help="other replicas a stream may continue on when its replica dies, is "
                        "drained or drops it (0: off)")
    p.add_argument("--admin-api", action="store_true",
                   help="serve POST/DELETE /router/backends (add or remove replicas at runtime)")
    add_tls_flags(p)
    add_tracing_flag(p)
    p.add_argument("--ext-proc-port", type=int, default=None, metavar="N",
                   help="also serve Envoy ext_proc (gRPC) on this port, as a Gateway API "
                        "Inference Extension endpoint picker (the same routing and state)")


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    """The hook for `quire`'s CLI: `add_router_parser(sub)` in its build_parser."""
    p = subparsers.add_parser("router", help="run the cluster request router",
                              description=__doc__.splitlines()[0])
    add_router_arguments(p)
    p.set_defaults(func=cmd_router)
    return p


def build_state(ns: argparse.Namespace):
    """The router's parts from its flags: (state, background tasks)."""
    import httpx

    from quire.router.backend_tls import backend_verify
    from quire.router.backends import BackendSet
    from quire.router.flow_control import FlowControl, Saturation
    from quire.router.holding import Holding
    from quire.router.load_scraper import LoadScraper
    from quire.router.metrics import RouterMetrics
    from quire.router.objectives import ObjectiveTable, parse_objective_flags
    from quire.router.policies import make_policy
    from quire.router.prefix_index import PrefixIndex
    from quire.router.prompt_hashing import PromptHasher, load_tokenizer
    from quire.router.proxy import RouterState

    if ns.backend and ns.k8s_service:
        raise ValueError("give --backend or --k8s-service, not both")
    for name in ("max_pending", "max_retries", "prefix_cache_entries", "migration_limit",
                 "flow_max_queued"):
        if getattr(ns, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    verify = backend_verify(ns.backend_ca_certs, ns.backend_check_hostname)
    backends = BackendSet(ns.backend, scheme=ns.backend_scheme)
    metrics = RouterMetrics()
    hasher = None
    events_index = subscriber = None
    if ns.routing == "precise-prefix":
        from quire.router.kv_event_index import KVEventIndex
        from quire.router.kv_event_subscriber import KVEventSubscriber
        if not ns.kv_events_bind or "://" not in ns.kv_events_bind:
            raise ValueError("--routing precise-prefix needs --kv-events-bind, a ZMQ endpoint "
                             f"such as tcp://*:5557; got {ns.kv_events_bind!r}")
        if ns.kv_events_max_blocks < 1:
            raise ValueError("--kv-events-max-blocks must be >= 1")
        events_index = KVEventIndex(ns.kv_events_max_blocks)
        subscriber = KVEventSubscriber(ns.kv_events_bind, events_index, ns.backend_scheme)
    policy = make_policy(ns.routing, PrefixIndex(max(1, ns.prefix_cache_entries)),
                         ns.prefix_load_factor, ns.prefix_load_slack, events_index)
    if ns.routing in ("prefix-aware", "precise-prefix"):
        hasher = PromptHasher(load_tokenizer(ns.model, ns.tokenizer), ns.block_size,
                              seed_with_model=ns.routing == "prefix-aware")
        backends.on_removed.append(policy.forget)
    client = httpx.AsyncClient(
        verify=verify, timeout=httpx.Timeout(ns.connect_timeout, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    flow = FlowControl(backends, metrics, Saturation(ns.saturation_queue_depth,
                                                     ns.saturation_kv_usage),
                       ns.flow_max_wait, ns.flow_max_queued, enabled=ns.flow_control)
    objectives = ObjectiveTable(parse_objective_flags(ns.objective))
    state = RouterState(backends=backends, policy=policy, metrics=metrics, client=client,
                        holding=Holding(backends, metrics, ns.max_pending, ns.hold_timeout),
                        hasher=hasher, max_retries=ns.max_retries, retry_after=ns.retry_after,
                        flow=flow, objectives=objectives, tenant_header=ns.tenant_header.lower()
                        if ns.tenant_header else None, migration_limit=ns.migration_limit)
    # The replicas' API key (the operator sets it from spec.runtime.apiKeySecret): only for the
    # router's own reads of /v1/models; clients' requests carry their own.
    background = [LoadScraper(backends, client, ns.scrape_interval, api_key=os.environ.get("QUIRE_API_KEY"),
                              on_scrape=flow.notify).run]
    if ns.k8s_service:
        background.append(_endpoint_slice_watch(ns, backends).run)
    if ns.watch_objectives:
        if not ns.k8s_service:
            raise ValueError("--watch-objectives needs --k8s-service (its namespace's API)")
        background.append(_objective_watch(ns, objectives).run)
    if subscriber is not None:
        background.append(subscriber.run)
    return state, background


def build_services(ns: argparse.Namespace, state) -> list:
    """Servers beside the HTTP app, in its event loop: the ext_proc endpoint picker."""
    if ns.ext_proc_port is None:
        return []
    if not 0 <= ns.ext_proc_port <= 65535 or ns.ext_proc_port == ns.port:
        raise ValueError(f"--ext-proc-port must be a port number other than --port "
                         f"({ns.port}), got {ns.ext_proc_port}")
    from quire.router.ext_proc import ExtProcServer
    return [ExtProcServer(state, ns.host, ns.ext_proc_port)]


def _objective_watch(ns, table):
    from quire.router.discovery_k8s import in_cluster, pod_namespace
    from quire.router.objectives import InferenceObjectiveWatch
    if ns.kube_api:
        api, headers, verify = ns.kube_api, {}, True
    else:
        api, headers, verify = in_cluster()
    return InferenceObjectiveWatch(api, ns.k8s_namespace or pod_namespace(), table,
                                   pool=ns.inference_pool, headers=headers, verify=verify)


def _endpoint_slice_watch(ns, backends):
    from quire.router.discovery_k8s import EndpointSliceWatch, in_cluster, pod_namespace
    if ns.kube_api:
        api, headers, verify = ns.kube_api, {}, True
    else:
        api, headers, verify = in_cluster()
    return EndpointSliceWatch(api, ns.k8s_namespace or pod_namespace(), ns.k8s_service,
                              backends.replace, port_name=ns.backend_port_name,
                              headers=headers, verify=verify, scheme=ns.backend_scheme)


def cmd_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from quire.router.app import build_app
    tls = tls_from(ns)
    state, background = build_state(ns)
    tracing = start_tracing(ns.otlp_traces_endpoint, "quire-router")
    app = build_app(state, background, admin_api=ns.admin_api,
                    tracer=tracing.tracer if tracing is not None else None,
                    services=build_services(ns, state))
    logger.info("quire router: %s routing, %s://%s:%d, backends from %s", ns.routing, tls.scheme,
                ns.host, ns.port, f"service {ns.k8s_service}" if ns.k8s_service
                else ", ".join(ns.backend) or "the admin API")
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                access_log=False, lifespan="on", log_config=None, timeout_graceful_shutdown=5,
                **tls.uvicorn_kwargs())
    if tracing is not None:
        tracing.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quire router", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    add_router_arguments(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return cmd_router(ns)
    except ValueError as e:
        print(f"quire router: error: {e}", file=sys.stderr)
        return 2
