"""spec.parallelism.tensor (issue 16): the pod runs `--tensor-parallel-size N`, holds N GPUs and a
memory-backed /dev/shm the workers share; a GPU count that contradicts N is refused."""

import pytest

from quire_operator.children import desired_deployment
from quire_operator.spec import SpecError, parse_spec

from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "big", "namespace": "default", "uid": "u"}}


def pod_of(spec: dict) -> dict:
    return desired_deployment(OWNER, parse_spec(spec), "img")["spec"]["template"]


def container_of(spec: dict) -> dict:
    (container,) = pod_of(spec)["spec"]["containers"]
    return container


def shm_of(pod: dict) -> dict:
    (container,) = pod["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume["emptyDir"]


def tp_flag(container: dict) -> str | None:
    args = container["args"]
    return args[args.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in args else None


def test_tensor_2_pod_has_two_gpus_shared_memory_and_the_flag():
    pod = pod_of({"parallelism": {"tensor": 2}, "resources": {"memory": "32Gi"}})
    (container,) = pod["spec"]["containers"]
    assert tp_flag(container) == "2"
    assert container["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": 2}
    assert shm_of(pod) == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_gpus_equal_to_tensor_is_the_same_pod():
    assert pod_of({"parallelism": {"tensor": 4}, "resources": {"gpus": 4}}) == pod_of({"parallelism": {"tensor": 4}})


def test_cpu_workers_request_no_gpu():
    # gpus: 0 says CPU: the workers talk over gloo (tests, small models).
    container = container_of({"parallelism": {"tensor": 2}, "resources": {"gpus": 0, "cpu": "4"}})
    assert tp_flag(container) == "2"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("tensor, size", [(2, "2Gi"), (8, "8Gi"), (16, "8Gi")])
def test_shared_memory_is_a_gibibyte_per_worker_up_to_eight(tensor, size):
    assert shm_of(pod_of({"parallelism": {"tensor": tensor}}))["sizeLimit"] == size


def test_shm_size_overrides_the_default():
    pod = pod_of({"parallelism": {"tensor": 2, "shmSize": "16Gi"}})
    assert shm_of(pod) == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert shm_of(pod_of({"parallelism": {"shmSize": "512Mi"}}))["sizeLimit"] == "512Mi"  # one worker too


def test_single_worker_pods_are_as_before():
    # An operator upgrade must not roll the pods of a spec that says nothing about parallelism.
    before = pod_of({"resources": {"gpus": 1}})
    assert pod_of({"resources": {"gpus": 1}, "parallelism": {"tensor": 1}}) == before
    assert tp_flag(before["spec"]["containers"][0]) is None
    assert shm_of(before) == {"medium": "Memory"}
    assert "nvidia.com/gpu" not in container_of({})["resources"].get("limits", {})
    # Without a parallelism section, any GPU count means what it meant before.
    assert container_of({"resources": {"gpus": 4}})["resources"]["limits"] == {"nvidia.com/gpu": 4}


@pytest.mark.parametrize("spec", [
    {"parallelism": {"tensor": 2}, "resources": {"gpus": 1}},
    {"parallelism": {"tensor": 2}, "resources": {"gpus": 4}},
    {"parallelism": {"tensor": 1}, "resources": {"gpus": 2}},
    {"parallelism": {}, "resources": {"gpus": 2}},  # tensor defaults to 1
])
def test_a_gpu_count_that_contradicts_tensor_names_both_fields(spec):
    with pytest.raises(SpecError) as raised:
        parse_spec(spec)
    assert raised.value.field == "spec.resources.gpus"
    assert "spec.parallelism.tensor" in str(raised.value)


@pytest.mark.parametrize("parallelism, field", [
    ({"tensor": 0}, "spec.parallelism.tensor"),
    ({"tensor": 17}, "spec.parallelism.tensor"),
    ({"tensor": "2"}, "spec.parallelism.tensor"),
    ({"tensor": 2.0}, "spec.parallelism.tensor"),
    ({"shmSize": "0"}, "spec.parallelism.shmSize"),
    ({"shmSize": "2GB"}, "spec.parallelism.shmSize"),
])
def test_bad_parallelism_is_named(parallelism, field):
    with pytest.raises(SpecError) as raised:
        parse_spec({"parallelism": parallelism})
    assert raised.value.field == field


def test_the_flag_belongs_to_the_spec_field():
    with pytest.raises(SpecError) as raised:
        parse_spec({"runtime": {"extraArgs": ["--tensor-parallel-size=2"]}})
    assert raised.value.field == "spec.runtime.extraArgs" and "set by the operator" in str(raised.value)


def test_the_running_operator_writes_the_tensor_parallel_pod(cluster):
    with running_operator():
        cluster.create(llmdeployment("big", model={"source": "Qwen/Qwen2.5-32B-Instruct"},
                                     parallelism={"tensor": 2}, resources={"memory": "160Gi"}))
        dep = wait_for(lambda: cluster.deployment("big"), what="the Deployment")
    pod = dep["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"][:2] == ["serve", "Qwen/Qwen2.5-32B-Instruct"]
    assert tp_flag(container) == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert shm_of(pod) == {"medium": "Memory", "sizeLimit": "2Gi"}
