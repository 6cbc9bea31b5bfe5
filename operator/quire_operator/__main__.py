"""`quire-operator`: run the kopf operator for LLMDeployments."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quire-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch LLMDeployments in every namespace (the default without --namespace)")
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch only this namespace; repeat for several")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help=f"where kopf serves its liveness probe (default {DEFAULT_LIVENESS}; '' to disable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kopf.configure(debug=args.verbose, verbose=args.verbose)
    logging.getLogger("quire_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    # One replica and no peering: the chart runs a single operator with the Recreate strategy.
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
