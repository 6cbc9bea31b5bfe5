"""Every state change and every failure is an Event; the log stays quiet while nothing changes
(issue 13, item 4)."""

import logging
import time

from quire_operator import handlers, names, quiet_indexers

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)


def reasons(cluster, name="chat"):
    return [(e["type"], e["reason"]) for e in cluster.events(name)]


def test_state_changes_are_events(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat"))
        wait_for(lambda: ("Normal", "Created") in reasons(cluster), what="Created")
        cluster.mark_deployment_available("chat")
        wait_for(lambda: ("Normal", "AllReplicasReady") in reasons(cluster), what="the Ready event")
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"runtime": {"maxNumSeqs": 8}}})
        wait_for(lambda: ("Normal", "Updated") in reasons(cluster), what="Updated")
        wait_for(lambda: ("Warning", "ReplicasNotReady") in reasons(cluster), what="not ready during the rollout")
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"runtime": {"blockSize": 3}}})
        wait_for(lambda: ("Warning", "InvalidSpec") in reasons(cluster), what="InvalidSpec")
    messages = {e["reason"]: e["message"] for e in cluster.events("chat")}
    assert messages["AllReplicasReady"] == "Ready is True: 1/1 replicas ready"
    assert [m for r, m in ((e["reason"], e["message"]) for e in cluster.events("chat")) if r == "Created"] == [
        "Deployment chat created (replicas=1)", "Service chat created"]


def test_a_failing_api_call_is_an_event_and_is_retried(cluster, monkeypatch):
    monkeypatch.setattr(handlers, "RETRY_DELAY_SECONDS", 1)
    cluster.running.call(lambda e: e.add_validation("deployments", lambda obj: "etcdserver: request timed out",
                                                    code=500))
    with running_operator():
        cluster.create(llmdeployment("chat"))
        failure = wait_for(lambda: [e for e in cluster.events("chat") if "request timed out" in e["message"]],
                           what="the failure as an Event")
        assert failure[0]["type"] in ("Warning", "Error")  # kopf posts its handler errors as "Error"
        assert "will retry" in failure[0]["message"] or "failed temporarily" in failure[0]["message"]
        cluster.running.call(lambda e: e.clear_validations())
        wait_for(lambda: cluster.deployment("chat"), what="the retry to create the Deployment")


def test_a_steady_autoscaler_logs_nothing_above_debug(cluster, caplog):
    caplog.set_level(logging.DEBUG)
    with running_operator():
        cluster.create(llmdeployment("chat", autoscaling={"enabled": True, "maxReplicas": 3, "pollIntervalSeconds": 1}))
        wait_for(lambda: ((cluster.llmd("chat").get("status") or {}).get("autoscaler") or {}).get("reason"),
                 what="a first poll")
        time.sleep(1)
        caplog.clear()
        polls = len([c for c in cluster.operator_calls() if c[1].endswith("/chat/scale")])
        wait_for(lambda: len([c for c in cluster.operator_calls() if c[1].endswith("/chat/scale")]) >= polls + 3,
                 what="three more polls")
        loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                if r.levelno >= logging.INFO and (r.name.startswith("quire_operator") or r.name.startswith("kopf.objects"))]
        debug = [r for r in caplog.records if r.name == "quire_operator.scaling" and r.levelno == logging.DEBUG]
    assert loud == []
    assert debug  # the ticks are still there at DEBUG


def test_indexer_successes_are_debug_and_their_failures_stay_loud(caplog):
    # kopf re-runs every indexer on every watch event; its per-event success line is noise.
    quiet_indexers.install()
    kopf_objects = logging.getLogger("kopf.objects")
    caplog.set_level(logging.INFO)
    kopf_objects.info("Indexer 'llmdeployments' succeeded.")
    kopf_objects.info("Handler 'reconcile_llmdeployment' succeeded.")
    kopf_objects.error("Indexer 'llmdeployments' failed with an exception.")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "Handler 'reconcile_llmdeployment' succeeded."),
        ("ERROR", "Indexer 'llmdeployments' failed with an exception.")]
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    kopf_objects.info("Indexer 'pods_by_llmdeployment' succeeded.")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "Indexer 'pods_by_llmdeployment' succeeded.")]
