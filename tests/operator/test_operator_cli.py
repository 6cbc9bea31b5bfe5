"""`quire-operator` runs kopf with the watch scope and liveness endpoint it is given."""

import kopf
import pytest

from quire_operator.__main__ import main


@pytest.mark.parametrize("argv, clusterwide, namespaces, liveness", [
    ([], True, [], "http://0.0.0.0:8080/healthz"),
    (["--all-namespaces"], True, [], "http://0.0.0.0:8080/healthz"),
    (["-n", "llm-a", "--namespace", "llm-b", "--liveness", "http://0.0.0.0:9090/healthz"],
     False, ["llm-a", "llm-b"], "http://0.0.0.0:9090/healthz"),
    (["--liveness", ""], True, [], None),
])
def test_arguments_reach_kopf(monkeypatch, argv, clusterwide, namespaces, liveness):
    calls = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    assert main(argv) == 0
    (kwargs,) = calls
    assert kwargs == {"standalone": True, "clusterwide": clusterwide, "namespaces": namespaces,
                      "liveness_endpoint": liveness}


def test_all_namespaces_and_namespace_exclude_each_other():
    with pytest.raises(SystemExit):
        main(["-A", "-n", "x"])
