"""Two operators, one leader (issue 13, item 6): real `quire-operator` processes against the
emulated API server, each with its own credentials so that every request says who made it.
The standby writes nothing but its attempts at the Lease; when the leader is killed the standby
takes over and carries on; a leader that stops cleanly hands the Lease over at once."""

from __future__ import annotations

import contextlib
import signal

import kmock

from quire_operator import names

from operator_harness import LLMD_API, cluster, llmdeployment, wait_for  # noqa: F401 (cluster is a fixture)
from operator_harness import operator_process as _operator_process

LEASE = "quire-operator"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/default/leases/{LEASE}"


def operator_process(cluster, tmp_path, identity):
    return _operator_process(cluster, tmp_path, identity, lease=LEASE)


def requests_of(cluster, identity: str) -> list[tuple[int, str, str]]:
    """(position in the server's request log, method, path) of every request `identity` made."""
    def collect(emulator):
        return [(i, r.method.value, r.url.path) for i, r in enumerate(emulator._requests)
                if r.headers.get("Authorization") == f"Bearer {identity}"]
    return cluster.running.call(collect)


def writes_of(cluster, identity: str, leases: bool = False) -> list[tuple[int, str, str]]:
    return [(i, m, p) for i, m, p in requests_of(cluster, identity)
            if m in ("POST", "PATCH", "PUT", "DELETE") and (("/leases" in p) == leases)]


def holder(cluster) -> str | None:
    lease = cluster.get("coordination.k8s.io/v1", "leases", LEASE)
    return (lease or {}).get("spec", {}).get("holderIdentity")


def holders_over_time(cluster) -> list[str]:
    def collect(emulator):
        stored = emulator.objects[kmock.resource("coordination.k8s.io", "v1", "leases"), "default", LEASE]
        return [v["spec"].get("holderIdentity") for v in stored.history if v]
    return cluster.running.call(collect)


def request_count(cluster) -> int:
    return cluster.running.call(lambda e: len(e._requests))


def test_one_leader_acts_the_standby_takes_over_and_nothing_is_written_twice(cluster, tmp_path):
    with operator_process(cluster, tmp_path, "op-a") as a:
        wait_for(lambda: holder(cluster) == "op-a", timeout=60, what="op-a to lead")
        with operator_process(cluster, tmp_path, "op-b") as b:
            wait_for(lambda: any(p == LEASE_PATH for _, _, p in requests_of(cluster, "op-b")), timeout=60,
                     what="op-b to look at the Lease")
            cluster.create(llmdeployment("chat", replicas=2))
            wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("observedGeneration") == 1, timeout=30,
                     what="op-a to apply the spec")
            cluster.mark_deployment_available("chat")
            wait_for(lambda: (cluster.llmd("chat")["status"]).get("readyReplicas") == 2, timeout=30)
            assert holder(cluster) == "op-a"
            # The standby only reads the Lease: no write at all, not even to the Lease.
            assert writes_of(cluster, "op-b") == [] and writes_of(cluster, "op-b", leases=True) == []
            assert {p for _, _, p in requests_of(cluster, "op-b")} == {LEASE_PATH}

            a.kill()  # a crash: no release, the Lease must expire
            killed_at = request_count(cluster)
            wait_for(lambda: holder(cluster) == "op-b", timeout=60, what="op-b to take over")
            taken_at = min(i for i, m, p in writes_of(cluster, "op-b", leases=True))

            # The new leader carries on: a spec change and a drift are both handled, once.
            cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"replicas": 3}})
            wait_for(lambda: cluster.deployment("chat")["spec"]["replicas"] == 3, timeout=30, what="op-b to scale")
            cluster.delete("v1", "services", "chat")
            wait_for(lambda: cluster.service("chat"), timeout=30, what="op-b to restore the Service")
            assert b.poll() is None

    a_writes, b_writes = writes_of(cluster, "op-a"), writes_of(cluster, "op-b")
    assert a_writes and b_writes
    # Only the leader wrote: op-a until it died, op-b only once it held the Lease.
    assert max(i for i, _, _ in a_writes) < killed_at
    assert min(i for i, _, _ in b_writes) > taken_at
    # Nothing twice: one Deployment created, one scale to 3, one Service re-created.
    creates = [p for _, m, p in a_writes + b_writes if m == "POST" and "/events" not in p]
    assert sorted(creates) == ["/api/v1/namespaces/default/services",
                               "/api/v1/namespaces/default/services",
                               "/apis/apps/v1/namespaces/default/deployments"]
    deployment_patches = [p for _, m, p in b_writes if m == "PATCH" and p.endswith("/deployments/chat")]
    assert len(deployment_patches) == 1
    assert holders_over_time(cluster)[0] == "op-a" and holders_over_time(cluster)[-1] == "op-b"


def test_a_leader_that_stops_cleanly_hands_the_lease_over(cluster, tmp_path):
    with operator_process(cluster, tmp_path, "op-a") as a:
        wait_for(lambda: holder(cluster) == "op-a", timeout=60, what="op-a to lead")
        with operator_process(cluster, tmp_path, "op-b"):
            wait_for(lambda: any(p == LEASE_PATH for _, _, p in requests_of(cluster, "op-b")), timeout=60,
                     what="op-b to look at the Lease")
            a.send_signal(signal.SIGTERM)
            assert a.wait(60) == 0
            # Released (holder emptied), then taken by the standby without waiting for expiry.
            assert holders_over_time(cluster)[-1] in ("", "op-b")
            wait_for(lambda: holder(cluster) == "op-b", timeout=60, what="op-b to take over")
    assert "" in holders_over_time(cluster)
    assert holders_over_time(cluster)[-1] == "op-b"


def test_a_leader_that_cannot_renew_stops_acting(cluster, tmp_path):
    with operator_process(cluster, tmp_path, "op-a") as a:
        wait_for(lambda: holder(cluster) == "op-a", timeout=60, what="op-a to lead")
        # Another replica holds the Lease now (op-a's renewals were lost, say) and keeps it fresh.
        with _keep_lease_held(cluster, "intruder"):
            assert a.wait(60) == 1  # op-a stops within its renew deadline, exit code 1: restart as a standby
        stopped_at = request_count(cluster)
        cluster.create(llmdeployment("chat"))
        wait_for(lambda: cluster.llmd("chat"))
    assert not [w for w in writes_of(cluster, "op-a") if w[0] > stopped_at]
    assert cluster.deployment("chat") is None


@contextlib.contextmanager
def _keep_lease_held(cluster, identity: str):
    import threading
    import time
    from datetime import datetime, timezone

    done = threading.Event()

    def renew():
        while not done.is_set():
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            cluster.patch("coordination.k8s.io/v1", "leases", LEASE,
                          {"spec": {"holderIdentity": identity, "renewTime": now}})
            time.sleep(0.5)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(5)
