"""`quire serve` over HTTPS with a throwaway CA: HTTPS works for a client that trusts the CA,
plain HTTP and clients that trust another CA get nothing, `--ssl-cert-reqs 2` refuses clients
without a certificate from the CA, and `quire router` proxies to the HTTPS replica, verifying it
with the CA it is given (and refusing it without)."""

from __future__ import annotations

import pytest
import requests

from router_harness import InProcessRouter, quire_serve, router, server_harness
from tls_certs import make_pki

HOST = "127.0.0.1"  # the server certificate names 127.0.0.1 and localhost


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(pki):
    """(HTTPS server, HTTPS server requiring client certificates), both ready."""
    tiny = server_harness().tiny_model()
    common = [tiny, "--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1",
              "--ssl-certfile", pki.server_cert, "--ssl-keyfile", pki.server_key]
    https = quire_serve("https", HOST, *common, ca=pki.ca)
    mutual = quire_serve("mutual", HOST, *common, "--ssl-ca-certs", pki.ca, "--ssl-cert-reqs", "2",
                         ca=pki.ca, cert=(pki.client_cert, pki.client_key))
    try:
        for p in (https, mutual):
            p.launch()
        for p in (https, mutual):
            p.wait_ready(300)
        yield https, mutual
    finally:
        for p in (https, mutual):
            p.stop()


def _complete(url: str, **tls) -> requests.Response:
    return requests.post(url + "/v1/completions", timeout=120, **tls,
                         json={"prompt": "one two three", "max_tokens": 3, "temperature": 0})


def test_https_with_the_ca_and_nothing_over_plain_http(servers, pki):
    https, _ = servers
    assert https.url.startswith("https://")
    answer = _complete(https.url, verify=pki.ca)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    # The certificate is the one the CA signed: a client trusting another CA refuses it.
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(https.url + "/health", verify=pki.other_ca, timeout=10)
    # Plain HTTP on the same port gets no answer at all.
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(https.url.replace("https://", "http://") + "/health", timeout=10)


def test_client_certificates_required(servers, pki):
    _, mutual = servers
    with pytest.raises(requests.exceptions.ConnectionError):  # no certificate: refused
        requests.get(mutual.url + "/health", verify=pki.ca, timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):  # one from another CA: refused
        requests.get(mutual.url + "/health", verify=pki.ca, timeout=10,
                     cert=(pki.stranger_cert, pki.stranger_key))
    answer = _complete(mutual.url, verify=pki.ca, cert=(pki.client_cert, pki.client_key))
    assert answer.status_code == 200, answer.text


def test_the_router_proxies_to_an_https_replica_it_verifies_with_the_ca(servers, pki):
    https, _ = servers
    # The router serves HTTPS itself too (same flags as quire serve).
    with router("--backend", https.url, "--backend-ca-certs", pki.ca, "--routing", "round-robin",
                "--ssl-certfile", pki.server_cert, "--ssl-keyfile", pki.server_key, host=HOST,
                ca=pki.ca) as r:
        assert r.url.startswith("https://")
        answer = _complete(r.url, verify=pki.ca)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
    # Without the CA, the replica's certificate proves nothing to the router: no request reaches it.
    with InProcessRouter("--backend", https.url, "--routing", "round-robin", "--max-retries", "0",
                         host=HOST) as plain:
        answer = _complete(plain.url)
        assert answer.status_code == 502, answer.text
