"""`quire-operator`: run the kopf operator for LLMDeployments, as the leader of its replicas."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import uuid

import kopf

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_LEASE_NAME = "quire-operator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quire-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch LLMDeployments in every namespace (the default without --namespace)")
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch only this namespace; repeat for several")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help=f"where kopf serves its liveness probe (default {DEFAULT_LIVENESS}; '' to disable)")
    parser.add_argument("--resync-seconds", type=float, default=None, metavar="S",
                        help="re-apply every LLMDeployment this often, changed or not (default 300)")
    election = parser.add_argument_group("leader election (one replica acts, the others wait)")
    election.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                          help="take a coordination.k8s.io Lease before acting (default: on)")
    election.add_argument("--lease-name", default=DEFAULT_LEASE_NAME)
    election.add_argument("--lease-namespace", default=None,
                          help="default: $POD_NAMESPACE, else the kubeconfig's namespace, else 'default'")
    election.add_argument("--identity", default=None,
                          help="this replica's name in the Lease (default: $POD_NAME or the host name, "
                               "plus a random suffix)")
    election.add_argument("--lease-duration", type=int, default=15, metavar="S")
    election.add_argument("--renew-deadline", type=float, default=10, metavar="S")
    election.add_argument("--retry-period", type=float, default=2, metavar="S")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    return parser


def _lease_namespace(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        import kubernetes
        _, context = kubernetes.config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG"))
        return (context or {}).get("context", {}).get("namespace") or "default"
    except Exception:
        return "default"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .network_policy import policy_settings
    try:
        policy_settings()  # the chart's networkPolicy settings: refused before anything starts
    except ValueError as e:
        print(f"quire-operator: error: {e}", file=sys.stderr)
        return 2
    kopf.configure(debug=args.verbose, verbose=args.verbose)
    logging.getLogger("quire_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    # kopf's stop flag is a future of its own loop: a threading.Event would be awaited in a
    # worker thread that a SIGTERM leaves blocked, and the loop would never finish closing.
    loop = asyncio.new_event_loop()
    kopf_stop = loop.create_future()
    stop, lost = threading.Event(), threading.Event()

    def stop_kopf() -> None:
        loop.call_soon_threadsafe(lambda: kopf_stop.done() or kopf_stop.set_result(None))

    elector = renewer = None
    if args.leader_election:
        elected = _elect(args, stop, lost, stop_kopf)
        if elected is None:
            return 0
        elector, renewer = elected
    try:
        kopf.run(
            loop=loop,
            standalone=True,  # no kopf peering: the Lease decides who acts
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness or None,
            stop_flag=kopf_stop,
            memo=kopf.Memo(resync_seconds=args.resync_seconds),
        )
    finally:
        loop.close()
        stop.set()  # ends the renewing thread
        if renewer is not None:
            renewer.join(30)
        if elector is not None and not lost.is_set():
            elector.release()
    # Lost leadership: exit non-zero, so the container restarts as a standby (as client-go does).
    return 1 if lost.is_set() else 0


def _elect(args: argparse.Namespace, stop: threading.Event, lost: threading.Event, stop_kopf):
    """Wait to lead, then keep renewing in a thread; None if stopped while waiting."""
    import kubernetes

    from .kube import kube, load_config
    from .leader import LeaderElector, LeaseSettings
    from .standby_probe import standby_probe

    load_config()
    kube.use(kubernetes.client.ApiClient())
    identity = args.identity or f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    elector = LeaderElector(kube, LeaseSettings(
        namespace=_lease_namespace(args.lease_namespace), name=args.lease_name, identity=identity,
        lease_duration=args.lease_duration, renew_deadline=args.renew_deadline, retry_period=args.retry_period))
    with standby_probe(args.liveness):
        if not elector.acquire(stop):
            return None

    def on_lost() -> None:
        lost.set()
        stop_kopf()  # kopf stops gracefully; main() then exits 1

    renewer = threading.Thread(target=elector.keep, args=(stop, on_lost), name="lease-renewer", daemon=True)
    renewer.start()
    return elector, renewer


if __name__ == "__main__":
    sys.exit(main())
