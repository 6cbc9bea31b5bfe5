"""spec.adapters and spec.lora (issue 15): validation naming the field, the runtime flags, the
claims mounted, a pod template that an adapter-list edit leaves alone, and one replica's plan."""

import base64

import pytest

from quire_operator.adapter_spec import AdapterSpec, lora_modules_in, runtime_lora
from quire_operator.adapter_sync import (
    ReplicaOutcome,
    adapter_rows,
    plan_replica,
    read_api_key,
    still_managed,
    summary,
)
from quire_operator.pod_template import pod_template, server_args
from quire_operator.spec import SpecError, parse_spec


def adapters(*pairs):
    return [{"name": n, "source": s} for n, s in pairs]


def test_sources_become_paths_inside_the_pod():
    spec = parse_spec({"adapters": adapters(("sql", "/mnt/loras/sql"), ("chat-v2", "pvc://loras/chat/v2/"))})
    assert [(a.name, a.path, a.claim) for a in spec.adapters] == [
        ("sql", "/mnt/loras/sql", None), ("chat-v2", "/adapters/loras/chat/v2", "loras")]


@pytest.mark.parametrize("raw, field, says", [
    (adapters(("sql", "oci://registry/sql:1")), "spec.adapters[0].source", "oci:// sources are not supported yet"),
    (adapters(("sql", "https://hf.co/x")), "spec.adapters[0].source", "https:// sources are not supported yet"),
    (adapters(("a", "/x"), ("sql", "s3://b/x")), "spec.adapters[1].source", "unknown scheme"),
    (adapters(("sql", "loras/sql")), "spec.adapters[0].source", "is not absolute"),
    (adapters(("sql", "/loras/../etc")), "spec.adapters[0].source", "'..'"),
    (adapters(("sql", "pvc://loras")), "spec.adapters[0].source", "names no folder inside the claim"),
    (adapters(("sql", "pvc://Bad_Claim/x")), "spec.adapters[0].source", "does not name a PersistentVolumeClaim"),
    (adapters(("sql", "pvc://loras/a/../../b")), "spec.adapters[0].source", "'..'"),
    (adapters(("SQL", "/x")), "spec.adapters[0].name", "is not a valid adapter name"),
    (adapters(("sql-", "/x")), "spec.adapters[0].name", "is not a valid adapter name"),
    ([{"source": "/x"}], "spec.adapters[0].name", "is required"),
    ([{"name": "sql"}], "spec.adapters[0].source", "is required"),
    ([{"name": "sql", "source": "/x", "rank": 8}], "spec.adapters[0].rank", "is not a field"),
    (adapters(("sql", "/x"), ("sql", "/y")), "spec.adapters[1].name", "already the name of spec.adapters[0]"),
    ("sql", "spec.adapters", "must be a list"),
    (adapters(("sql", "/" + "x" * 600)), "spec.adapters[0].source", "at most 512"),
])
def test_bad_adapters_name_the_field_and_what_is_allowed(raw, field, says):
    with pytest.raises(SpecError) as caught:
        parse_spec({"adapters": raw})
    assert caught.value.field == field
    assert says in str(caught.value)


def test_a_fetched_source_says_what_is_allowed_instead():
    with pytest.raises(SpecError) as caught:
        parse_spec({"adapters": adapters(("sql", "oci://registry/sql:1"))})
    assert str(caught.value) == ("spec.adapters[0].source: 'oci://registry/sql:1': oci:// sources are not "
                                 "supported yet; use an absolute path inside the pod (on a volume you mount) "
                                 "or pvc://<claim>/<path>")


def test_adapter_names_may_not_shadow_the_base_model_or_user_lora_modules():
    with pytest.raises(SpecError, match=r"spec.adapters\[0\].name: 'chat' is taken: it is the base model"):
        parse_spec({"model": {"servedName": "chat"}, "adapters": adapters(("chat", "/x"))})
    with pytest.raises(SpecError, match=r"spec.adapters\[0\].name: 'mine' is taken: --lora-modules"):
        parse_spec({"runtime": {"extraArgs": ["--lora-modules", "mine=/m", "other=/o"]},
                    "adapters": adapters(("mine", "/x"))})


def test_lora_modules_are_read_from_extra_args_in_both_spellings():
    assert lora_modules_in(["--lora-modules", "a=/a", "b=/b", "--max-loras", "2"]) == {"a", "b"}
    assert lora_modules_in(["--lora-modules=a=/a", "--log-requests"]) == {"a"}
    assert lora_modules_in(["--max-loras", "2"]) == set()


@pytest.mark.parametrize("lora, field", [
    ({"maxLoras": 0}, "spec.lora.maxLoras"),
    ({"maxLoraRank": "16"}, "spec.lora.maxLoraRank"),
    ({"maxLoras": 4, "maxCpuLoras": 2}, "spec.lora.maxCpuLoras"),
    ({"syncIntervalSeconds": 0}, "spec.lora.syncIntervalSeconds"),
    ({"maxAdapters": 2}, "spec.lora.maxAdapters"),
])
def test_bad_lora_limits_name_the_field(lora, field):
    with pytest.raises(SpecError) as caught:
        parse_spec({"lora": lora})
    assert caught.value.field == field


def test_lora_is_refused_with_tensor_parallelism():
    with pytest.raises(SpecError, match=r"spec.adapters: LoRA is not supported with spec.parallelism.tensor 2"):
        parse_spec({"parallelism": {"tensor": 2}, "adapters": adapters(("sql", "/x"))})


def test_lora_flags_when_lora_or_adapters_are_set_and_none_otherwise():
    assert "--enable-lora" not in server_args(parse_spec({}))
    only_adapters = server_args(parse_spec({"adapters": adapters(("sql", "/x"))}))
    assert only_adapters[-2:] == ["--enable-lora", "--allow-runtime-lora"]
    limits = server_args(parse_spec({"lora": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8},
                                     "runtime": {"extraArgs": ["--log-requests"]}}))
    assert limits[limits.index("--enable-lora"):] == [
        "--enable-lora", "--allow-runtime-lora", "--max-loras", "4", "--max-lora-rank", "64",
        "--max-cpu-loras", "8", "--log-requests"]  # spec.runtime.extraArgs still come last
    assert "sql" not in " ".join(only_adapters)  # adapters go through the API, never the args


def test_the_pod_template_changes_only_for_a_new_claim():
    def template(*pairs):
        return pod_template("chat", parse_spec({"lora": {}, "adapters": adapters(*pairs)}), "img")

    base = template()
    assert template(("sql", "/mnt/sql")) == base
    assert template(("sql", "/mnt/sql"), ("b", "/mnt/b")) == base
    one_claim = template(("sql", "pvc://loras/sql"))
    assert one_claim != base
    # More adapters on the same claim, in any order: the same template.
    assert template(("b", "pvc://loras/b"), ("sql", "pvc://loras/sql"), ("c", "/mnt/c")) == one_claim
    pod = one_claim["spec"]
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/adapters/loras", "readOnly": True}
    # A second claim adds its volume and leaves the first one's name alone.
    two = template(("sql", "pvc://loras/sql"), ("x", "pvc://a-first/x"))["spec"]["volumes"]
    assert volume in two and len(two) == len(pod["volumes"]) + 1


SQL = AdapterSpec("sql", "/m/sql", "/m/sql")
CHAT = AdapterSpec("chat", "/m/chat", "/m/chat")


def test_plan_loads_what_is_missing_and_unloads_only_what_the_operator_manages():
    present = {"sql": "/m/sql", "old": "/m/old", "users": "/u"}
    plan = plan_replica([SQL, CHAT], managed={"sql", "old"}, present=present)
    assert plan.unload == ("old",)  # "users" was loaded by someone else: left alone
    assert plan.load == (CHAT,)


def test_plan_reloads_an_adapter_whose_source_changed():
    plan = plan_replica([SQL], managed={"sql"}, present={"sql": "/m/sql-v1"})
    assert plan.unload == ("sql",) and plan.load == (SQL,)
    assert plan_replica([SQL], managed={"sql"}, present={"sql": "/m/sql/"}).load == ()  # the same folder


def test_rows_summary_and_what_stays_managed():
    outcomes = [ReplicaOutcome("chat-0", {"sql": "/m/sql", "old": "/m/old"}),
                ReplicaOutcome("chat-1", {}, failures={"sql": "HTTP 400: rank 64 > 16"}),
                ReplicaOutcome("chat-2", None, error="no answer")]
    rows = adapter_rows([SQL, CHAT], outcomes)
    assert rows[0] == {"name": "sql", "source": "/m/sql", "readyReplicas": 1, "replicas": 3, "ready": "1/3",
                       "message": "chat-1: HTTP 400: rank 64 > 16; chat-2: no answer"}
    assert summary(rows) == "0/2"
    assert summary(adapter_rows([SQL], outcomes[:1])) == "1/1"
    # chat-2 did not answer: every dropped name may still be there.
    assert still_managed([SQL], {"old", "done"}, outcomes) == ["done", "old", "sql"]
    # All answered: "old" is still on chat-0, "done" is nowhere.
    assert still_managed([SQL], {"old", "done"}, outcomes[:2]) == ["old", "sql"]
    # A pod not ready now was not asked: it may come back with "done" still loaded.
    assert still_managed([SQL], {"old", "done"}, outcomes[:2], pods_left_out=True) == ["done", "old", "sql"]


def test_only_pods_started_with_runtime_lora_are_synced():
    def pod(spec):
        return pod_template("chat", parse_spec(spec), "img")["spec"]

    assert runtime_lora(pod({"adapters": adapters(("sql", "/x"))}))
    assert not runtime_lora(pod({}))  # an old pod while the rollout that turns LoRA on runs


class SecretsOnly:
    def __init__(self, secrets):
        self.secrets = secrets

    def get(self, group, version, plural, namespace, name):
        assert (group, version, plural) == ("", "v1", "secrets")
        return self.secrets.get(name)


def test_the_api_key_is_read_from_the_secret_exactly():
    def secret(value):
        return {"data": {"api-key": base64.b64encode(value.encode()).decode()}}

    kube = SecretsOnly({"good": secret("k3y"), "echoed": secret("k3y\n")})
    assert read_api_key(kube, "default", None) is None
    assert read_api_key(kube, "default", ("good", "api-key")) == "k3y"
    with pytest.raises(KeyError, match="Secret 'gone' does not exist"):
        read_api_key(kube, "default", ("gone", "api-key"))
    with pytest.raises(KeyError, match="Secret 'good' has no key 'token'"):
        read_api_key(kube, "default", ("good", "token"))
    with pytest.raises(ValueError, match="starts or ends with whitespace"):
        read_api_key(kube, "default", ("echoed", "api-key"))
