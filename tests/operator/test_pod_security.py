"""Every pod the operator makes passes the "restricted" Pod Security Standard and runs with a
read-only root filesystem, writing only to emptyDirs that HOME, XDG_CACHE_HOME and TMPDIR name
(issue 36)."""

import pytest

from quire_operator.children import desired_deployment
from quire_operator.lws_children import desired_leaderworkerset
from quire_operator.router_children import desired_router_deployment
from quire_operator.spec import parse_spec

from restricted_profile import assert_restricted, violations

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "default", "uid": "u"}}
GGUF = "/models/qwen.gguf"

SPECS = {
    "defaults": {},
    "model and cache claims": {"model": {"source": "qwen.gguf", "pvc": {"claimName": "models"},
                                         "cache": {"claimName": "hf-cache"}}},
    "tensor parallel": {"parallelism": {"tensor": 2}, "resources": {"memory": "32Gi"}},
    "adapters from a claim": {"lora": {"maxLoras": 2},
                              "adapters": [{"name": "sql", "source": "pvc://loras/sql"}]},
    "api key, env, image": {"image": "registry.example.com/quire:1", "imagePullPolicy": "Always",
                            "env": [{"name": "QUIRE_NUM_THREADS", "value": "4"}],
                            "runtime": {"apiKeySecret": {"name": "key"}}},
    "router, least-load": {"router": {"enabled": True, "routing": "least-load"}},
    "router, prefix-aware on a claim": {
        "model": {"source": "qwen.gguf", "pvc": {"claimName": "models"}},
        "router": {"enabled": True, "routing": "prefix-aware"}},
    "multi-node, TLS": {"parallelism": {"tensor": 2, "pipeline": 2}, "tls": {"secretName": "tls"}},
}


def deployments(raw: dict) -> list[dict]:
    spec = parse_spec(raw)
    if spec.parallelism.multi_node:  # a LeaderWorkerSet: its leader's and its workers' pods
        template = desired_leaderworkerset(OWNER, spec, "img")["spec"]["leaderWorkerTemplate"]
        made = [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"chat-{role}"},
                 "spec": {"template": template[f"{role}Template"]}} for role in ("leader", "worker")]
    else:
        made = [desired_deployment(OWNER, spec, "img")]
    if spec.router.enabled:
        made.append(desired_router_deployment(OWNER, spec.router, "img"))
    return made


@pytest.mark.parametrize("name", SPECS)
def test_every_operator_deployment_passes_the_restricted_profile(name):
    for deployment in deployments(SPECS[name]):
        assert_restricted(deployment)


@pytest.mark.parametrize("name", SPECS)
def test_the_caches_and_tmp_point_at_writable_volumes(name):
    """With the root read-only, every place `quire` writes (quire/writable_dirs.py: the cache
    from XDG_CACHE_HOME or HOME, temporary files from TMPDIR) is an emptyDir mount."""
    for deployment in deployments(SPECS[name]):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = [m["mountPath"] for m in container["volumeMounts"]
                    if m["name"] in empty_dirs and not m.get("readOnly")]
        env = {e["name"]: e.get("value") for e in container["env"]}
        for var in ("HOME", "XDG_CACHE_HOME", "TMPDIR"):
            assert any(env[var] == path or env[var].startswith(path + "/") for path in writable), \
                (deployment["metadata"]["name"], var, env[var], writable)
        assert env["PYTHONDONTWRITEBYTECODE"] == "1"
        names = [e["name"] for e in container["env"]]
        assert len(names) == len(set(names)), names


def test_an_env_the_spec_sets_is_kept_and_not_doubled():
    (deployment,) = deployments({"env": [{"name": "HOME", "value": "/data/home"}]})
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    homes = [e for e in container["env"] if e["name"] == "HOME"]
    assert homes == [{"name": "HOME", "value": "/data/home"}]
    assert {"name": "TMPDIR", "value": "/tmp"} in container["env"]


def test_the_runtime_pod_runs_as_the_images_user():
    (deployment,) = deployments({})
    pod = deployment["spec"]["template"]["spec"]
    # The Dockerfile's serving image: USER 1000:1000, HOME /home/quire.
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (1000, 1000)
    (container,) = pod["containers"]
    assert {"name": "home", "mountPath": "/home/quire"} in container["volumeMounts"]


def test_the_checker_sees_a_weakened_operator_pod():
    """The same checker on an operator pod with its guards taken off: it must object."""
    (deployment,) = deployments({})
    pod = deployment["spec"]["template"]["spec"]
    del pod["securityContext"]["runAsNonRoot"]
    pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    problems = violations(pod)
    assert any(p.startswith("Running as Non-root:") for p in problems), problems
    assert any(p.startswith("Read-only root") for p in problems), problems
