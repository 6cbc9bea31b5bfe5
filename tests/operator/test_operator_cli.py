"""`quire-operator` runs kopf with the watch scope and liveness endpoint it is given, as the leader."""

import kopf
import pytest

from quire_operator import __main__ as cli
from quire_operator.__main__ import main


@pytest.fixture
def kopf_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    return calls


@pytest.mark.parametrize("argv, clusterwide, namespaces, liveness", [
    ([], True, [], "http://0.0.0.0:8080/healthz"),
    (["--all-namespaces"], True, [], "http://0.0.0.0:8080/healthz"),
    (["-n", "llm-a", "--namespace", "llm-b", "--liveness", "http://0.0.0.0:9090/healthz"],
     False, ["llm-a", "llm-b"], "http://0.0.0.0:9090/healthz"),
    (["--liveness", ""], True, [], None),
])
def test_arguments_reach_kopf(kopf_calls, argv, clusterwide, namespaces, liveness):
    assert main(["--no-leader-election", *argv]) == 0
    (kwargs,) = kopf_calls
    assert {k: kwargs[k] for k in ("standalone", "clusterwide", "namespaces", "liveness_endpoint")} == {
        "standalone": True, "clusterwide": clusterwide, "namespaces": namespaces, "liveness_endpoint": liveness}
    assert kwargs["memo"]["resync_seconds"] is None


def test_resync_period_reaches_the_handlers(kopf_calls):
    assert main(["--no-leader-election", "--resync-seconds", "30"]) == 0
    assert kopf_calls[0]["memo"]["resync_seconds"] == 30


def test_kopf_runs_only_once_elected_and_releases_the_lease_after(kopf_calls, monkeypatch):
    order = []

    class Elector:
        def release(self):
            order.append("release")

    class Renewer:
        def join(self, timeout):
            order.append("joined")

    monkeypatch.setattr(cli, "_elect", lambda args, stop, lost, stop_kopf: (order.append("elected"), (Elector(), Renewer()))[1])
    monkeypatch.setattr(kopf, "run", lambda **kwargs: order.append("kopf"))
    assert main([]) == 0
    assert order == ["elected", "kopf", "joined", "release"]


def test_stopped_while_waiting_to_lead_never_runs_kopf(kopf_calls, monkeypatch):
    monkeypatch.setattr(cli, "_elect", lambda args, stop, lost, stop_kopf: None)
    assert main([]) == 0
    assert kopf_calls == []


def test_lost_leadership_exits_non_zero_and_keeps_the_lease_untouched(kopf_calls, monkeypatch):
    released = []

    class Elector:
        def release(self):
            released.append(True)

    class Renewer:
        def join(self, timeout):
            pass

    def elect(args, stop, lost, stop_kopf):
        lost.set()  # as the renewing thread does when it cannot renew in time
        return Elector(), Renewer()

    monkeypatch.setattr(cli, "_elect", elect)
    assert main([]) == 1
    assert released == []


def test_all_namespaces_and_namespace_exclude_each_other():
    with pytest.raises(SystemExit):
        main(["-A", "-n", "x"])


def test_a_standby_answers_the_liveness_probe_until_kopf_takes_over():
    import socket
    import urllib.error
    import urllib.request

    from quire_operator.standby_probe import standby_probe

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/healthz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with standby_probe(url):
        with opener.open(url, timeout=5) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError):
            opener.open(f"http://127.0.0.1:{port}/other", timeout=5)
    with pytest.raises(urllib.error.URLError):  # the port is free again for kopf's own endpoint
        opener.open(url, timeout=5)
