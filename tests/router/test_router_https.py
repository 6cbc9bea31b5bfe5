"""The router towards HTTPS replicas as the operator runs it: pod IPs that the certificate does
not name, verified against the deployment's CA (`--backend-scheme https --backend-ca-certs
--no-backend-check-hostname`); and its refusals of flag combinations that would prove nothing."""

from __future__ import annotations

import pytest
import requests

from quire.router.backend_tls import backend_verify
from quire.router.backends import BackendSet
from quire.router.discovery_k8s import ready_urls

from router_harness import InProcessRouter, fake_backend
from tls_certs import make_pki

POD_IP = "127.0.0.15"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    # As a cert-manager Certificate for the Service would be: its DNS name, no pod IP.
    return make_pki(tmp_path_factory.mktemp("pki"), server_names=("chat.default.svc",), server_ips=())


@pytest.fixture(scope="module")
def pod(pki):
    with fake_backend("pod", POD_IP, tls=(pki.server_cert, pki.server_key)) as proc:
        yield proc


def _ask(router) -> requests.Response:
    return requests.post(router.url + "/v1/completions", timeout=30,
                         json={"prompt": "hello", "max_tokens": 2})


def test_a_pod_ip_is_trusted_through_the_ca_when_names_are_not_checked(pod, pki):
    address = f"{POD_IP}:{pod.url.rsplit(':', 1)[1]}"  # as discovery finds it: no scheme
    trusting = ["--backend", address, "--backend-scheme", "https", "--backend-ca-certs", pki.ca,
                "--routing", "round-robin", "--max-retries", "0"]
    with InProcessRouter(*trusting, "--no-backend-check-hostname") as router:
        answer = _ask(router)
        assert answer.status_code == 200, answer.text
        assert answer.json()["backend"] == "pod"
    # Names checked: the certificate does not name the pod's IP.
    with InProcessRouter(*trusting) as router:
        assert _ask(router).status_code == 502
    # A CA that did not sign it: refused whether names are checked or not.
    with InProcessRouter("--backend", address, "--backend-scheme", "https", "--backend-ca-certs",
                         pki.other_ca, "--no-backend-check-hostname", "--max-retries", "0") as router:
        assert _ask(router).status_code == 502


def test_backend_tls_flags_that_prove_nothing_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--no-backend-check-hostname needs --backend-ca-certs"):
        backend_verify(None, check_hostname=False)
    with pytest.raises(ValueError, match="--backend-ca-certs: cannot load"):
        backend_verify(str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--backend-ca-certs: cannot load"):
        backend_verify(str(tmp_path / "junk.pem"))
    assert backend_verify(None) is True  # the public CAs, names checked: httpx's default


def test_the_backend_scheme_reaches_discovered_and_bare_urls():
    slices = {"s": {"ports": [{"name": "http", "port": 8000}],
                    "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True}}]}}
    assert ready_urls(slices, "http", None, "https") == {"https://10.0.0.7:8000"}
    backends = BackendSet(["10.0.0.8:8000", "http://10.0.0.9:8000"], scheme="https")
    assert sorted(b.url for b in backends.all()) == ["http://10.0.0.9:8000", "https://10.0.0.8:8000"]
