"""HTTPS for `quire serve` and `quire router`: uvicorn's (and vLLM's) four flags, checked.

    --ssl-certfile FILE   the server's certificate (PEM; its chain may follow it)
    --ssl-keyfile FILE    its private key (PEM)
    --ssl-ca-certs FILE   the CAs that client certificates must chain to
    --ssl-cert-reqs N     client certificates: 0 (ssl.CERT_NONE, default), 1 (CERT_OPTIONAL:
                          checked when sent), 2 (CERT_REQUIRED)

Without --ssl-certfile the server speaks plain HTTP, as before. The files are loaded once
here, before the model is, so that a wrong path or a key that does not match its certificate
is a one-line error naming the flag, not a traceback from inside uvicorn after start-up.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass

CERT_REQS = {"CERT_NONE": ssl.CERT_NONE, "CERT_OPTIONAL": ssl.CERT_OPTIONAL,
             "CERT_REQUIRED": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class ServerTLS:
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's arguments for this; none for plain HTTP."""
        if not self.certfile:
            return {}
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                "ssl_ca_certs": self.ca_certs, "ssl_cert_reqs": self.cert_reqs}


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; needs --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="the certificate's private key (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates (PEM) that client certificates must chain to")
    p.add_argument("--ssl-cert-reqs", type=cert_reqs, default=ssl.CERT_NONE, metavar="N",
                   help="client certificates: 0 (CERT_NONE, the default), 1 (CERT_OPTIONAL: "
                        "verified when sent), 2 (CERT_REQUIRED: refused without one); "
                        "1 and 2 need --ssl-ca-certs")


def cert_reqs(text: str) -> int:
    """--ssl-cert-reqs: 0, 1, 2 as uvicorn and vLLM take it, or ssl's names for them."""
    name = text.strip().upper()
    if name in ("0", "1", "2"):
        return int(name)
    for spelling in (name, "CERT_" + name):
        if spelling in CERT_REQS:
            return int(CERT_REQS[spelling])
    raise argparse.ArgumentTypeError(
        f"{text!r} is not one of 0 (CERT_NONE), 1 (CERT_OPTIONAL), 2 (CERT_REQUIRED)")


def tls_from(ns: argparse.Namespace) -> ServerTLS:
    """The flags as one checked value; raises ValueError naming the flag at fault."""
    tls = ServerTLS(ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs)
    if tls.certfile and not tls.keyfile:
        raise ValueError("--ssl-certfile needs --ssl-keyfile (the certificate's private key)")
    if tls.keyfile and not tls.certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate it belongs to)")
    if not tls.certfile:
        if tls.ca_certs or tls.cert_reqs != ssl.CERT_NONE:
            flag = "--ssl-ca-certs" if tls.ca_certs else "--ssl-cert-reqs"
            raise ValueError(f"{flag} needs --ssl-certfile and --ssl-keyfile (client "
                             "certificates are only asked for over HTTPS)")
        return tls
    if tls.cert_reqs != ssl.CERT_NONE and not tls.ca_certs:
        raise ValueError(f"--ssl-cert-reqs {tls.cert_reqs} needs --ssl-ca-certs (the CA that "
                         "client certificates must chain to)")
    _check_loadable(tls)
    return tls


def _check_loadable(tls: ServerTLS) -> None:
    for flag, path in (("--ssl-certfile", tls.certfile), ("--ssl-keyfile", tls.keyfile),
                       ("--ssl-ca-certs", tls.ca_certs)):
        if path is None:
            continue
        try:  # ssl's own errors do not say which file they could not open
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {tls.certfile} / --ssl-keyfile {tls.keyfile}: not a "
                         f"PEM certificate and its matching private key ({e})") from None
    if tls.ca_certs:
        try:
            context.load_verify_locations(tls.ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs: cannot load CA certificates from "
                             f"{tls.ca_certs} ({e})") from None
