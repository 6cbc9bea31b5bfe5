"""How the router checks the certificates of https:// replicas.

`--backend-ca-certs FILE`: the replicas' certificates must chain to a CA in FILE (only those;
not the public CAs). Any certificate in FILE counts as a trust anchor (OpenSSL's partial-chain
mode, Python 3.13's default), so FILE may also be the replicas' own certificate, pinned.
Names are checked as usual, unless `--no-backend-check-hostname`: replicas found through
EndpointSlices are pod IPs, which a certificate for the Service seldom names; the private CA
then stands for their identity. Without a CA file the public CAs apply, and their names are
always checked (any web site holds a certificate from one of them).
"""

from __future__ import annotations

import ssl


def backend_verify(ca_certs: str | None, check_hostname: bool = True) -> ssl.SSLContext | bool:
    """httpx's `verify` for the router's client; raises ValueError naming the flag at fault."""
    if ca_certs is None:
        if not check_hostname:
            raise ValueError("--no-backend-check-hostname needs --backend-ca-certs: against the "
                             "public CAs, a certificate whose name is not checked proves nothing")
        return True  # httpx's default: certifi's CAs, names checked
    try:
        context = ssl.create_default_context(cafile=ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--backend-ca-certs: cannot load CA certificates from {ca_certs} "
                         f"({e})") from None
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.check_hostname = check_hostname
    return context
