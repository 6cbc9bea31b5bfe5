"""spec.adapters end to end (issue 15): the operator loads every adapter on every ready replica
through the runtime's API, unloads what the spec drops, reports per-adapter readiness, and never
touches the pod template for it. Replicas are stand-ins with exactly the runtime's adapter API
(runtime_pod.FakeLoraRuntime), each on its own loopback IP; the last test runs two real
`quire serve` replicas (a tiny random Llama, random PEFT adapters) with the pod template's own
arguments."""

import base64

import requests

from quire_operator import names

from deployment_controller import DeploymentController
from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)
from runtime_pod import fake_lora_runtimes, free_port, quire_processes

POD_IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
TIMEOUT = 30  # generous: the machine may be loaded; every wait polls until true
SQL = {"name": "sql", "source": "/mnt/loras/sql"}


def status(cluster) -> dict:
    return cluster.llmd("chat").get("status") or {}


def rows(cluster) -> dict:
    return {r["name"]: r for r in status(cluster).get("adapters") or []}


def events(cluster, reason: str) -> list[dict]:
    return [e for e in cluster.events("chat") if e["reason"] == reason]


def set_adapters(cluster, adapters: list[dict]) -> None:
    cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"adapters": adapters}})


def test_every_replica_gets_the_adapters_and_the_pods_are_never_touched(cluster):
    port = free_port(*POD_IPS)
    # A sync interval of an hour: every sync below comes from a spec change or a replica turning ready.
    spec = dict(port=port, replicas=2, lora={"maxLoras": 2, "syncIntervalSeconds": 3600},
                runtime={"extraArgs": ["--lora-modules", "mine=/user/mine"]})
    with fake_lora_runtimes(POD_IPS, port, preloaded={"mine": "/user/mine"}) as runtimes, running_operator():
        cluster.create(llmdeployment("chat", **spec))
        with DeploymentController(cluster, "chat", POD_IPS) as controller:
            wait_for(lambda: len(controller.pods()) == 2, timeout=TIMEOUT, what="two pods")
            dep = cluster.deployment("chat")
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--enable-lora"):args.index("--enable-lora") + 4] == [
                "--enable-lora", "--allow-runtime-lora", "--max-loras", "2"]
            wait_for(lambda: status(cluster).get("adaptersReady") == "0/0", timeout=TIMEOUT, what="a first sync")

            set_adapters(cluster, [SQL])
            wait_for(lambda: all("sql" in r.loaded() for r in runtimes[:2]), timeout=TIMEOUT, what="both loads")
            assert runtimes[0].loaded()["sql"] == "/mnt/loras/sql"
            row = wait_for(lambda: rows(cluster).get("sql", {}).get("ready") == "2/2" and rows(cluster)["sql"],
                           timeout=TIMEOUT, what="sql ready on 2/2")
            assert row == {"name": "sql", "source": "/mnt/loras/sql", "readyReplicas": 2, "replicas": 2, "ready": "2/2"}
            assert status(cluster)["adaptersReady"] == "1/1"
            loaded = wait_for(lambda: events(cluster, "AdapterLoaded"), timeout=TIMEOUT, what="AdapterLoaded")
            assert loaded[0]["type"] == "Normal"
            assert loaded[0]["message"] == "adapter sql loaded on chat-0, chat-1; ready on 2/2 replicas"
            # Adding an adapter rolled nothing: the Deployment is as it was.
            after = cluster.deployment("chat")
            assert after["metadata"]["generation"] == dep["metadata"]["generation"]
            assert after["spec"]["template"] == dep["spec"]["template"]

            # A third replica gets the adapter as soon as it is ready.
            cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"replicas": 3}})
            wait_for(lambda: "sql" in runtimes[2].loaded(), timeout=TIMEOUT, what="the third replica's load")
            wait_for(lambda: rows(cluster).get("sql", {}).get("ready") == "3/3", timeout=TIMEOUT, what="3/3")

            # Dropped from the spec: unloaded everywhere; the user's --lora-modules adapter stays.
            set_adapters(cluster, [])
            wait_for(lambda: all(r.loaded() == {"mine": "/user/mine"} for r in runtimes), timeout=TIMEOUT,
                     what="sql unloaded from every replica")
            wait_for(lambda: status(cluster).get("managedAdapters") == [] and status(cluster)["adaptersReady"] == "0/0",
                     timeout=TIMEOUT, what="nothing left to manage")
            unloaded = wait_for(lambda: events(cluster, "AdapterUnloaded"), timeout=TIMEOUT, what="AdapterUnloaded")
            assert unloaded[0]["message"] == ("adapter sql unloaded from chat-0, chat-1, chat-2 "
                                              "(no longer in spec.adapters)")
            assert cluster.deployment("chat")["spec"]["template"] == dep["spec"]["template"]
    # Each replica was asked exactly once to load and once to unload: no churn between syncs.
    for runtime in runtimes:
        assert runtime.calls == [("/v1/load_lora_adapter", "sql"), ("/v1/unload_lora_adapter", "sql")]


def test_a_replica_that_refuses_is_reported_and_retried_while_the_others_serve(cluster):
    port = free_port(*POD_IPS[:2])
    key = "s3cret"
    with fake_lora_runtimes(POD_IPS[:2], port, api_key=key) as (first, second), running_operator():
        cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-key"},
                        "data": {"api-key": base64.b64encode(key.encode()).decode()}})
        second.refuse["big"] = "adapter 'big' has rank 64, above --max-lora-rank 16"
        cluster.create(llmdeployment("chat", port=port, replicas=2, runtime={"apiKeySecret": {"name": "chat-key"}},
                                     lora={"syncIntervalSeconds": 1},
                                     adapters=[{"name": "big", "source": "/mnt/loras/big"}]))
        with DeploymentController(cluster, "chat", POD_IPS[:2]):
            row = wait_for(lambda: rows(cluster).get("big", {}).get("ready") == "1/2" and rows(cluster)["big"],
                           timeout=TIMEOUT, what="big ready on 1/2")
            assert row["message"] == "chat-1: HTTP 400: adapter 'big' has rank 64, above --max-lora-rank 16"
            assert status(cluster)["adaptersReady"] == "0/1"
            assert "big" in first.loaded()
            warning = wait_for(lambda: events(cluster, "AdapterLoadFailed"), timeout=TIMEOUT, what="the Warning")
            assert warning[0]["type"] == "Warning"
            assert warning[0]["message"] == ("adapter big failed on pod chat-1: HTTP 400: adapter 'big' has rank 64, "
                                             "above --max-lora-rank 16; retrying every 1s")
            # Retried every second, told once.
            wait_for(lambda: second.calls.count(("/v1/load_lora_adapter", "big")) >= 3, timeout=TIMEOUT,
                     what="retries")
            assert len(events(cluster, "AdapterLoadFailed")) == 1

            del second.refuse["big"]  # e.g. the replica was rolled with a larger --max-lora-rank
            wait_for(lambda: rows(cluster).get("big", {}).get("ready") == "2/2", timeout=TIMEOUT, what="2/2")
            assert "message" not in rows(cluster)["big"]
            assert status(cluster)["adaptersReady"] == "1/1"
            wait_for(lambda: [e for e in events(cluster, "AdapterLoaded") if "chat-1" in e["message"]],
                     timeout=TIMEOUT, what="the late load's Event")
    # Every call carried the key from the Secret.
    assert first.unauthorized == second.unauthorized == 0
    assert first.calls == [("/v1/load_lora_adapter", "big")]


def test_lora_off_roll_is_once_and_a_new_claim_is_the_only_template_change(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat"))
        plain = wait_for(lambda: cluster.deployment("chat"), timeout=TIMEOUT)
        assert "--enable-lora" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]

        set_adapters(cluster, [SQL])  # LoRA turns on: the one roll
        on = wait_for(lambda: (d := cluster.deployment("chat"))["metadata"]["generation"] > 1 and d, timeout=TIMEOUT)
        assert "--enable-lora" in on["spec"]["template"]["spec"]["containers"][0]["args"]

        set_adapters(cluster, [SQL, {"name": "b", "source": "/mnt/loras/b"}])
        wait_for(lambda: cluster.llmd("chat")["status"].get("observedGeneration") == 3, timeout=TIMEOUT)
        assert cluster.deployment("chat")["metadata"]["generation"] == on["metadata"]["generation"]

        set_adapters(cluster, [SQL, {"name": "b", "source": "pvc://loras/b"}])  # a claim to mount
        mounted = wait_for(lambda: (d := cluster.deployment("chat"))["metadata"]["generation"]
                           > on["metadata"]["generation"] and d, timeout=TIMEOUT)
        volumes = mounted["spec"]["template"]["spec"]["volumes"]
        assert {"claimName": "loras", "readOnly": True} in [v.get("persistentVolumeClaim") for v in volumes]
        # No replica is ready: the sync reports that no replica serves it yet.
        wait_for(lambda: rows(cluster).get("b", {}).get("ready") == "0/0", timeout=TIMEOUT, what="b on 0/0")
        assert status(cluster)["adaptersReady"] == "0/2"


def test_two_real_replicas_serve_the_adapters_of_the_spec(cluster):
    from lora_helpers import save_random_adapter
    from server_harness import tiny_model, tmp_root

    base = tiny_model()
    sql = save_random_adapter(base, f"{tmp_root()}/operator-loras/sql", r=8, lora_alpha=16, seed=21, std=0.06)
    too_big = save_random_adapter(base, f"{tmp_root()}/operator-loras/big", r=32, seed=22)
    ips, key = POD_IPS[:2], "real-key"
    port = free_port(*ips)
    spec = dict(model={"source": base, "servedName": "tiny-base"}, port=port, replicas=2,
                runtime={"dtype": "float32", "apiKeySecret": {"name": "chat-key"},
                         "extraArgs": ["--kv-cache-memory", "16M", "--num-threads", "1"]},
                lora={"maxLoras": 2, "maxLoraRank": 16, "syncIntervalSeconds": 2},
                adapters=[{"name": "sql", "source": sql}, {"name": "big", "source": too_big}])
    with running_operator():
        cluster.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-key"},
                        "data": {"api-key": base64.b64encode(key.encode()).decode()}})
        cluster.create(llmdeployment("chat", **spec))
        container = wait_for(lambda: cluster.deployment("chat"), timeout=TIMEOUT)["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "QUIRE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "chat-key", "key": "api-key"}}} \
            in container["env"]

        def pod_args(ip: str) -> list[str]:  # what the kubelet runs, on this test's loopback IP
            args = list(container["args"])
            args[args.index("--host") + 1] = ip
            return args

        with quire_processes([(ip, port, pod_args(ip), {"QUIRE_API_KEY": key}) for ip in ips]), \
                DeploymentController(cluster, "chat", ips):
            wait_for(lambda: rows(cluster).get("sql", {}).get("ready") == "2/2", timeout=TIMEOUT, what="sql on 2/2")
            big = wait_for(lambda: rows(cluster).get("big", {}).get("message") and rows(cluster)["big"],
                           timeout=TIMEOUT, what="big refused")
            assert big["ready"] == "0/2" and "max_lora_rank" in big["message"], big
            warnings = wait_for(lambda: len(events(cluster, "AdapterLoadFailed")) == 2 and events(cluster, "AdapterLoadFailed"),
                                timeout=TIMEOUT, what="a Warning per replica")
            assert {w["message"].split(": ")[0] for w in warnings} == {"adapter big failed on pod chat-0",
                                                                     "adapter big failed on pod chat-1"}
            # Both replicas answer for the adapter, with the key from the Secret.
            for ip in ips:
                answer = requests.post(f"http://{ip}:{port}/v1/completions", timeout=60,
                                       headers={"Authorization": f"Bearer {key}"},
                                       json={"model": "sql", "prompt": "SELECT", "max_tokens": 4})
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == "sql"

            set_adapters(cluster, [{"name": "big", "source": too_big}])
            wait_for(lambda: all(model_ids(ip, port, key) == {"tiny-base"} for ip in ips), timeout=TIMEOUT,
                     what="sql unloaded from both replicas")
            wait_for(lambda: status(cluster).get("managedAdapters") == ["big"], timeout=TIMEOUT)
            # The runtime reports the folder it was given: no reload between syncs.
            assert not [e for e in events(cluster, "AdapterUnloaded") if "source changed" in e["message"]]
            assert len(events(cluster, "AdapterLoaded")) <= 2


def model_ids(ip: str, port: int, key: str) -> set[str]:
    answer = requests.get(f"http://{ip}:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return {m["id"] for m in answer.json()["data"]}


def test_an_adapter_dropped_while_the_operator_was_down_is_unloaded_when_it_is_back(cluster):
    port = free_port(*POD_IPS[:2])
    with fake_lora_runtimes(POD_IPS[:2], port) as runtimes:
        with running_operator():
            cluster.create(llmdeployment("chat", port=port, replicas=2, adapters=[SQL]))
            with DeploymentController(cluster, "chat", POD_IPS[:2]):
                wait_for(lambda: rows(cluster).get("sql", {}).get("ready") == "2/2", timeout=TIMEOUT, what="2/2")
        assert status(cluster)["managedAdapters"] == ["sql"]
        set_adapters(cluster, [{"name": "chat-v2", "source": "/mnt/loras/chat-v2"}])  # nobody is watching
        runtimes[0].adapters["by-hand"] = "/mnt/by-hand"  # someone else's: never the operator's to unload
        with running_operator(), DeploymentController(cluster, "chat", POD_IPS[:2]):
            wait_for(lambda: all(r.loaded().keys() - {"by-hand"} == {"chat-v2"} for r in runtimes), timeout=TIMEOUT,
                     what="sql swapped for chat-v2 on both replicas")
            wait_for(lambda: status(cluster).get("managedAdapters") == ["chat-v2"], timeout=TIMEOUT)
        assert runtimes[0].loaded()["by-hand"] == "/mnt/by-hand"
