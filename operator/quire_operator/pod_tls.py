"""The operator's own HTTPS calls to its pods (metric scrapes, the adapter API): whom to trust.

It reads spec.tls's Secret: the ca.crt in it when there is one, else tls.crt itself (pinned: a
self-signed certificate, or the chain of the one every replica serves). Certificates are checked
against that and nothing else; names are not, since pods are called by IP (tls_spec.py says why).
Read at every poll, so a renewed Secret is trusted at once.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import replace

from .kube import Kube
from .tls_spec import CA_KEY, CERT_KEY, TLSSpec


class TLSTrustError(Exception):
    """spec.tls's Secret cannot be read or holds no certificate: the pods cannot be verified."""


def trust_key_of(secret: dict | None) -> str:
    """The Secret's file that verifies the pods: ca.crt when present (a missing Secret: ca.crt,
    what cert-manager writes; the pods wait for the Secret anyway)."""
    data = (secret or {}).get("data") or {}
    return CERT_KEY if secret is not None and not data.get(CA_KEY) else CA_KEY


def with_trust_key(kube: Kube, namespace: str, tls: TLSSpec) -> TLSSpec:
    """spec.tls with the file the router must trust, from the Secret as it is now."""
    if not tls.enabled:
        return tls
    secret = kube.get("", "v1", "secrets", namespace, tls.secret_name)
    return replace(tls, trust_key=trust_key_of(secret))


def client_context(kube: Kube, namespace: str, tls: TLSSpec) -> ssl.SSLContext | None:
    """An SSL context that trusts only the Secret's CA; None without spec.tls. Raises TLSTrustError."""
    if not tls.enabled:
        return None
    secret = kube.get("", "v1", "secrets", namespace, tls.secret_name)
    if secret is None:
        raise TLSTrustError(f"the Secret {tls.secret_name!r} of spec.tls.secretName does not exist")
    key = trust_key_of(secret)
    encoded = (secret.get("data") or {}).get(key)
    if not encoded:
        raise TLSTrustError(f"the Secret {tls.secret_name!r} of spec.tls.secretName has neither ca.crt nor tls.crt")
    try:
        return context_trusting(base64.b64decode(encoded).decode("ascii"))
    except (ValueError, ssl.SSLError) as e:
        raise TLSTrustError(f"the {key} of Secret {tls.secret_name!r} is not a PEM certificate: {e}") from e


def context_trusting(pem: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=pem)
    context.check_hostname = False  # pods are called by IP; the CA is the identity
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # tls.crt pinned: a leaf may anchor
    return context
