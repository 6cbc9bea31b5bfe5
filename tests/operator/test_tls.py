"""spec.tls (issue 36): the Secret mounted, `--ssl-*` passed, probes over HTTPS, in the runtime
pods and the router; the operator's own scrapes verify the pods with the Secret's CA (and only
it); a bad secretName is refused naming the field."""

from __future__ import annotations

import base64
import contextlib
from dataclasses import replace

import pytest

from quire_operator import names
from quire_operator.adapter_client import RuntimeAdapters
from quire_operator.children import desired_deployment, endpoint
from quire_operator.pod_tls import TLSTrustError, client_context, trust_key_of, with_trust_key
from quire_operator.router_children import desired_router_deployment
from quire_operator.scrape import scrape
from quire_operator.spec import SpecError, parse_spec
from quire_operator.tls_spec import TLSSpec

from deployment_controller import DeploymentController
from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)
from runtime_pod import fixed_metrics_pod, free_port
from tls_certs import make_pki

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "default", "uid": "u1"}}
POD_IPS = ["127.0.0.2", "127.0.0.3"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    # As a cert-manager Certificate for the Service would be: its names, never a pod IP.
    return make_pki(tmp_path_factory.mktemp("pki"), server_names=("chat.default.svc", "chat"), server_ips=())


def tls_secret(pki, name: str = "chat-tls", with_ca: bool = True) -> dict:
    data = {"tls.crt": pki.server_cert_pem, "tls.key": pki.server_key_pem}
    if with_ca:
        data["ca.crt"] = pki.ca_pem
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": {"name": name},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


class FakeKube:
    """Only what pod_tls reads: Secrets by name."""

    def __init__(self, *secrets: dict) -> None:
        self.secrets = {s["metadata"]["name"]: s for s in secrets}

    def get(self, group, version, plural, namespace, name):
        assert (group, version, plural) == ("", "v1", "secrets")
        return self.secrets.get(name)


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def test_the_secret_is_mounted_and_https_turned_on_in_the_runtime_pods():
    spec = parse_spec({"port": 9000, "tls": {"secretName": "chat-tls"}})
    template = desired_deployment(OWNER, spec, "quire:1")["spec"]["template"]
    container = _container(template)
    assert {"name": "tls", "secret": {"secretName": "chat-tls"}} in template["spec"]["volumes"]
    assert {"name": "tls", "mountPath": "/etc/quire/tls", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--ssl-certfile") + 1] == "/etc/quire/tls/tls.crt"
    assert args[args.index("--ssl-keyfile") + 1] == "/etc/quire/tls/tls.key"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    assert endpoint(OWNER, spec) == "https://chat.default.svc:9000"


def test_without_tls_the_pods_stay_as_they_were():
    template = desired_deployment(OWNER, parse_spec({}), "quire:1")["spec"]["template"]
    container = _container(template)
    # (the read-only root's writable emptyDirs, pod_security.py, are there with or without TLS)
    assert not any("secret" in v for v in template["spec"]["volumes"])
    assert not any(a.startswith("--ssl") for a in container["args"])
    assert all("scheme" not in container[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert "prometheus.io/scheme" not in template["metadata"]["annotations"]
    assert endpoint(OWNER, parse_spec({})) == "http://chat.default.svc:8000"


@pytest.mark.parametrize("trust_key", ["ca.crt", "tls.crt"])
def test_the_router_serves_https_and_verifies_replicas_with_the_secrets_ca(trust_key):
    spec = parse_spec({"router": {"enabled": True}, "tls": {"secretName": "chat-tls"}}).router
    spec = replace(spec, tls=TLSSpec("chat-tls", trust_key))
    template = desired_router_deployment(OWNER, spec, "quire:1")["spec"]["template"]
    container = _container(template)
    args = container["args"]
    assert args[args.index("--ssl-certfile") + 1] == "/etc/quire/tls/tls.crt"
    assert args[args.index("--backend-scheme") + 1] == "https"
    assert args[args.index("--backend-ca-certs") + 1] == f"/etc/quire/tls/{trust_key}"
    assert "--no-backend-check-hostname" in args  # replicas are pod IPs
    assert {"name": "tls", "secret": {"secretName": "chat-tls"}} in template["spec"]["volumes"]
    assert {"name": "tls", "mountPath": "/etc/quire/tls", "readOnly": True} in container["volumeMounts"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_the_router_trusts_ca_crt_and_else_the_certificate_itself(pki):
    tls = TLSSpec("chat-tls")
    assert with_trust_key(FakeKube(tls_secret(pki)), "default", tls).trust_key == "ca.crt"
    assert with_trust_key(FakeKube(tls_secret(pki, with_ca=False)), "default", tls).trust_key == "tls.crt"
    assert trust_key_of(None) == "ca.crt"  # not there yet: what cert-manager will write


@pytest.mark.parametrize("tls, said", [
    ({}, "spec.tls.secretName: is required"),
    ({"secretName": "Chat_TLS"}, "spec.tls.secretName: 'Chat_TLS' is not a Secret name"),
    ({"secretName": "a" * 254}, "is not a Secret name"),
    ({"secretName": 7}, "spec.tls.secretName: 7 is not a Secret name"),
    ("chat-tls", "spec.tls: must be an object"),
])
def test_bad_tls_specs_are_refused_naming_the_field(tls, said):
    with pytest.raises(SpecError) as error:
        parse_spec({"tls": tls})
    assert said in str(error.value)


def test_ssl_flags_belong_to_spec_tls():
    with pytest.raises(SpecError, match="--ssl-certfile is set by the operator; use spec.tls instead"):
        parse_spec({"runtime": {"extraArgs": ["--ssl-certfile", "/x.pem"]}})
    assert parse_spec({"tls": {"secretName": "my.tls-1"}}).tls.secret_name == "my.tls-1"


def test_scrapes_verify_the_pod_with_the_secrets_ca_and_only_it(pki):
    ip = POD_IPS[0]
    port = free_port(ip)
    other = make_pki(pki.ca.rsplit("/", 1)[0] + "/other", server_names=("chat.default.svc",), server_ips=())
    with fixed_metrics_pod(ip, port, waiting=3, kv_usage=0.5, tls=(pki.server_cert, pki.server_key)):
        ca_trust = client_context(FakeKube(tls_secret(pki)), "default", TLSSpec("chat-tls"))
        assert scrape(ip, port, tls=ca_trust)["quire:num_requests_waiting"] == 3.0
        pinned = client_context(FakeKube(tls_secret(pki, with_ca=False)), "default", TLSSpec("chat-tls"))
        assert scrape(ip, port, tls=pinned)["quire:num_requests_waiting"] == 3.0
        strangers = client_context(FakeKube(tls_secret(other)), "default", TLSSpec("chat-tls"))
        assert scrape(ip, port, tls=strangers) is None  # another CA: no data, as a failed scrape
        assert scrape(ip, port) is None  # plain HTTP gets nothing either
    assert RuntimeAdapters(ip, port, tls=ca_trust).base == f"https://{ip}:{port}"  # the adapter API too
    assert client_context(FakeKube(), "default", TLSSpec()) is None  # no spec.tls: plain HTTP
    with pytest.raises(TLSTrustError, match="does not exist"):
        client_context(FakeKube(), "default", TLSSpec("chat-tls"))


def test_the_operator_scales_https_pods_and_writes_https_children(cluster, pki):
    port = free_port(*POD_IPS)
    with contextlib.ExitStack() as pods:
        for ip in POD_IPS:
            pods.enter_context(fixed_metrics_pod(ip, port, waiting=12, kv_usage=0.1,
                                                 tls=(pki.server_cert, pki.server_key)))
        with running_operator():
            cluster.create(tls_secret(pki))
            cluster.create(llmdeployment("chat", port=port, replicas=1, tls={"secretName": "chat-tls"},
                                         router={"enabled": True, "routing": "least-load"},
                                         autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                                      "targetQueueDepth": 2, "pollIntervalSeconds": 1}))
            with DeploymentController(cluster, "chat", POD_IPS):
                # Queue 12 per pod, scraped over HTTPS: 1 -> 2.
                scaler = wait_for(lambda: (a := (cluster.llmd("chat").get("status") or {}).get("autoscaler") or {})
                                  .get("observedQueueDepth") and a, timeout=30, what="a scrape over HTTPS")
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 2, timeout=30, what="the scale-up")
            router = wait_for(lambda: cluster.deployment("chat-router"), what="the router's Deployment")
            status = cluster.llmd("chat")["status"]

    assert scaler["observedQueueDepth"] == 12
    assert status["endpoint"] == f"https://chat.default.svc:{port}"
    runtime = _container(cluster.deployment("chat")["spec"]["template"])
    assert "--ssl-certfile" in runtime["args"] and runtime["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    args = _container(router["spec"]["template"])["args"]
    assert args[args.index("--backend-ca-certs") + 1] == "/etc/quire/tls/ca.crt"
    assert router["spec"]["template"]["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY
