"""`spec.tls`: HTTPS for the serving pods and the router, from a kubernetes.io/tls Secret.

    spec:
      tls:
        secretName: chat-tls   # tls.crt and tls.key; ca.crt too when the issuer writes one

The Secret is mounted read-only at TLS_MOUNT in the runtime pods (`quire serve --ssl-certfile
--ssl-keyfile`) and, with spec.router, in the router pods, which serve HTTPS with the same
certificate and reach the replicas over HTTPS. Probes then use HTTPS (the kubelet does not
verify certificates). Who calls a pod by its IP (the router, the operator's scrapes and adapter
calls) verifies the pod's certificate against the Secret's ca.crt, or, without one, against
tls.crt itself (a self-signed certificate is its own CA); pod IPs are rarely in a certificate,
so names are not checked there: only certificates from that CA are accepted.

Pure functions here; reading the Secret is pod_tls.py's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .spec_error import SpecError

TLS_MOUNT = "/etc/quire/tls"
TLS_VOLUME = "tls"
CERT_KEY, KEY_KEY, CA_KEY = "tls.crt", "tls.key", "ca.crt"
# A Secret's name is a DNS-1123 subdomain (the CRD carries the same rule).
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_SECRET_NAME_LENGTH = 253


@dataclass(frozen=True)
class TLSSpec:
    secret_name: str | None = None
    # The Secret's file that verifies the replicas: ca.crt unless the operator found none (pod_tls.py).
    trust_key: str = CA_KEY

    @property
    def enabled(self) -> bool:
        return self.secret_name is not None

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"


def parse_tls(raw_spec: Mapping[str, Any] | None) -> TLSSpec:
    raw = (raw_spec or {}).get("tls")
    if raw is None:
        return TLSSpec()
    if not isinstance(raw, Mapping):
        raise SpecError("spec.tls", f"must be an object, not {type(raw).__name__}")
    name = raw.get("secretName")
    path = "spec.tls.secretName"
    if name is None:
        raise SpecError(path, "is required: the kubernetes.io/tls Secret holding tls.crt and tls.key")
    if not isinstance(name, str) or len(name) > MAX_SECRET_NAME_LENGTH or not re.match(SECRET_NAME_PATTERN, name):
        raise SpecError(path, f"{name!r} is not a Secret name (DNS-1123: lower-case letters, digits, '-' and '.', "
                              f"starting and ending with a letter or digit, at most {MAX_SECRET_NAME_LENGTH} characters)")
    return TLSSpec(secret_name=name)


def tls_volume(tls: TLSSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): the Secret, read-only; nothing without spec.tls."""
    if not tls.enabled:
        return [], []
    return ([{"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name}}],
            [{"name": TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}])


def server_tls_args(tls: TLSSpec) -> list[str]:
    """`quire serve` and `quire router` serve HTTPS with the Secret's certificate."""
    if not tls.enabled:
        return []
    return ["--ssl-certfile", f"{TLS_MOUNT}/{CERT_KEY}", "--ssl-keyfile", f"{TLS_MOUNT}/{KEY_KEY}"]


def backend_tls_args(tls: TLSSpec) -> list[str]:
    """`quire router` reaches the replicas (pod IPs from EndpointSlices) over HTTPS, verified by the Secret's CA."""
    if not tls.enabled:
        return []
    return ["--backend-scheme", "https", "--backend-ca-certs", f"{TLS_MOUNT}/{tls.trust_key}",
            "--no-backend-check-hostname"]


def with_https(probe_get: dict, tls: TLSSpec) -> dict:
    """A probe's httpGet, over HTTPS with spec.tls (the kubelet skips verification)."""
    return {**probe_get, "scheme": "HTTPS"} if tls.enabled else probe_get
