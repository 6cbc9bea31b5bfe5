"""Multi-LoRA over HTTP: live `quire serve` processes on a tiny random Llama with random PEFT
adapters. Adapters loaded at start (--lora-modules) and at runtime (/v1/load_lora_adapter)
answer completions and chat, whole and streamed, exactly as LLM.generate with that
lora_request (greedy); /v1/models lists them with their parent; unloading lets running
requests finish and makes the name a 404; the endpoints need the API key and exist only with
--allow-runtime-lora; the LoRA metrics show an adapter while its request runs; no KV block
is left in use."""

from __future__ import annotations

import json
import os
import threading
import time

import openai
import pytest
import requests

from quire import LLM, LoRARequest, SamplingParams

from lora_helpers import edit_adapter_config, save_random_adapter
from server_harness import (
    API_KEY,
    FAULT_LAUNCHER,
    ServerProcess,
    metric,
    metrics_of,
    tiny_model,
    tmp_root,
    wait_idle,
)

BASE, ALIAS = "tiny-base", "tiny-alias"
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMMON = ["--dtype", "float32", "--kv-cache-memory", "16M",
          "--num-threads", "1", "--no-enable-prefix-caching", "--enable-lora",
          "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4"]


@pytest.fixture(scope="module")
def adapters():
    """name -> folder: 'a' (rank 8, all seven targets), 'b' (rank 4, attention only) and
    broken ones."""
    base, root = tiny_model(), os.path.join(tmp_root(), "lora-adapters")
    out = {
        "a": save_random_adapter(base, f"{root}/a", r=8, lora_alpha=16, seed=11, std=0.06),
        "b": save_random_adapter(base, f"{root}/b", r=4, lora_alpha=8, seed=12, std=0.08,
                                 targets=["q_proj", "v_proj", "o_proj"]),
        "rank32": save_random_adapter(base, f"{root}/rank32", r=32, seed=13),
        "lm_head": save_random_adapter(base, f"{root}/lm_head", r=4, seed=14,
                                       targets=["q_proj"]),
        "not_peft": f"{root}/not_peft",
        "corrupt": save_random_adapter(base, f"{root}/corrupt", r=4, seed=15,
                                       targets=["q_proj"]),
    }
    with open(f"{out['corrupt']}/adapter_model.safetensors", "r+b") as f:
        f.truncate(100)
    edit_adapter_config(out["lm_head"], target_modules=["q_proj", "lm_head"])
    os.makedirs(out["not_peft"])
    with open(f"{out['not_peft']}/model.safetensors", "w") as f:
        f.write("not an adapter")
    return out


@pytest.fixture(scope="module")
def servers(adapters):
    """'runtime': runtime loading on, the API key, the slow-prompt launcher, vLLM's metric
    names, adapter 'b' from the start in vLLM's JSON form. 'static': --lora-modules in the
    name=path form and no --allow-runtime-lora."""
    b_json = json.dumps({"name": "b", "path": adapters["b"], "base_model_name": BASE})
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
    procs = {
        "runtime": ServerProcess("lora-runtime", [
            tiny_model(), *COMMON, "--served-model-name", BASE, ALIAS,
            "--allow-runtime-lora", "--metrics-compat", "vllm",
            "--lora-modules", b_json], env={**env, "QUIRE_API_KEY": API_KEY},
            api_key=API_KEY, launcher=FAULT_LAUNCHER),
        "static": ServerProcess("lora-static", [
            tiny_model(), *COMMON, "--served-model-name", BASE,
            "--lora-modules", f"a={adapters['a']}"]),
    }
    for p in procs.values():
        p.env = {**env, **p.env}
        p.start()
    try:
        for p in procs.values():
            p.wait_ready(300)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers["runtime"]


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def reference(adapters):
    """LLM.generate in this process, per adapter name (None: the base model): greedy
    outputs for PROMPTS, and for the CHAT conversation."""
    llm = LLM(tiny_model(), dtype="float32", kv_cache_memory=16 << 20, num_threads=1,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat_ids = llm.apply_chat_template(CHAT, True, None, None)
    out = {}
    for i, name in enumerate([None, "a", "b"]):
        lora = None if name is None else LoRARequest(name, i, adapters[name])
        outs = llm.generate(PROMPTS + [{"prompt_token_ids": chat_ids}], params,
                            use_tqdm=False, lora_request=lora)
        out[name] = [o.outputs[0].text for o in outs]
    return out


def post(srv, path, body, headers=AUTH):
    return requests.post(srv.url + path, json=body, headers=headers, timeout=60)


def models(srv, headers=AUTH) -> dict[str, dict]:
    r = requests.get(srv.url + "/v1/models", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def completions(client, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0).choices[0].text for p in PROMPTS]


def streamed_completion(client, model: str, prompt: str) -> str:
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat(client, model: str, stream: bool = False) -> str:
    if not stream:
        r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.model == model
        return r.choices[0].message.content
    chunks = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def not_found(model: str) -> dict:
    return {"error": {"message": f"The model `{model}` does not exist.",
                      "type": "NotFoundError", "param": "model", "code": 404}}


def test_the_adapters_change_the_output(reference):
    """Else matching the reference would not show the adapter was applied."""
    assert reference["a"] != reference[None] and reference["b"] != reference[None]


def test_load_request_unload(srv, client, adapters, reference):
    """The operator's contract: /v1/models, load, requests by name, unload, 404."""
    listed = models(srv)
    assert listed[BASE]["parent"] is None and "a" not in listed
    r = post(srv, LOAD, {"lora_name": "a", "lora_path": adapters["a"]})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'a' added successfully."
    r = post(srv, LOAD, {"lora_name": "a", "lora_path": adapters["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The lora adapter 'a' has already been loaded."
    listed = models(srv)
    assert {k: listed["a"][k] for k in ("id", "object", "root", "parent")} == {
        "id": "a", "object": "model", "root": adapters["a"], "parent": BASE}
    assert listed["a"]["owned_by"]

    ref_a, ref_base = reference["a"], reference[None]
    assert completions(client, "a") == ref_a[:len(PROMPTS)]
    assert completions(client, BASE) == ref_base[:len(PROMPTS)]  # the base is untouched
    assert streamed_completion(client, "a", PROMPTS[0]) == ref_a[0]
    assert chat(client, "a") == ref_a[-1]
    assert chat(client, "a", stream=True) == ref_a[-1]
    r = post(srv, "/generate", {"model": "a", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                "temperature": 0})
    assert r.json()["text"] == [PROMPTS[1] + ref_a[1]]

    r = post(srv, UNLOAD, {"lora_name": "a"})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'a' removed successfully."
    assert "a" not in models(srv)
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        r = post(srv, path, {**body, "model": "a", "max_tokens": 2})
        assert r.status_code == 404 and r.json() == not_found("a"), r.text
    r = post(srv, UNLOAD, {"lora_name": "a", "lora_int_id": 7})
    assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]
    # loaded again under the same name: served again, same answers
    assert post(srv, LOAD, {"lora_name": "a", "lora_path": adapters["a"]}).status_code == 200
    assert completions(client, "a")[:1] == ref_a[:1]
    assert post(srv, UNLOAD, {"lora_name": "a"}).status_code == 200


def test_lora_modules_at_start_json_form(srv, client, reference):
    listed = models(srv)
    assert listed["b"]["parent"] == BASE and listed["b"]["root"].endswith("/b")
    assert completions(client, "b") == reference["b"][:len(PROMPTS)]


def test_every_served_name_picks_the_base_model(srv, client, reference):
    listed = models(srv)
    assert listed[BASE]["parent"] is None and listed[ALIAS]["parent"] is None
    assert completions(client, ALIAS) == reference[None][:len(PROMPTS)]
    r = client.completions.create(model=ALIAS, prompt="hi", max_tokens=1)
    assert r.model == ALIAS  # the name asked for, as vLLM answers


def test_unknown_model_is_openai_404(srv):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": CHAT}),
                       ("/generate", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
        r = post(srv, path, {**body, "model": "no-such-adapter"})
        assert r.status_code == 404 and r.json() == not_found("no-such-adapter"), (path, r.text)
    r = post(srv, "/tokenize", {"model": "b", "prompt": "hi"})  # adapters tokenize like base
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_the_api_key_guards_load_and_unload(srv, adapters):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = post(srv, LOAD, {"lora_name": "x", "lora_path": adapters["a"]}, headers)
        assert r.status_code == 401
        r = post(srv, UNLOAD, {"lora_name": "b"}, headers)
        assert r.status_code == 401
    assert "x" not in models(srv) and "b" in models(srv)


@pytest.mark.parametrize("body, param, words", [
    ({"lora_path": "/tmp"}, "lora_name", "lora_name"),
    ({"lora_name": "x"}, "lora_path", "lora_path"),
    ({"lora_name": 5, "lora_path": "/tmp"}, "lora_name", "lora_name"),
    ({"lora_name": "", "lora_path": "/tmp"}, "lora_name", "lora_name"),
    ({"lora_name": "x", "lora_path": " "}, "lora_path", "lora_path"),
    ({"lora_name": BASE, "lora_path": "/tmp"}, "lora_name", "base model"),
    ({"lora_name": "x", "lora_path": "/no/such/folder"}, "lora_path", "adapter_config.json"),
    ({"lora_name": "x", "lora_path": "rank32"}, "lora_path", "max_lora_rank"),
    ({"lora_name": "x", "lora_path": "lm_head"}, "lora_path", "lm_head"),
    ({"lora_name": "x", "lora_path": "not_peft"}, "lora_path", "PEFT"),
    ({"lora_name": "x", "lora_path": "corrupt"}, "lora_path", "could not be read"),
    ({"lora_name": "b", "lora_path": "a"}, "lora_name", "already been loaded"),
])
def test_bad_loads_are_400_naming_the_problem(srv, adapters, body, param, words):
    if body.get("lora_path") in adapters:
        body = {**body, "lora_path": adapters[body["lora_path"]]}
    r = post(srv, LOAD, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "x" not in models(srv)


def test_bad_unloads(srv):
    r = post(srv, UNLOAD, {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = post(srv, UNLOAD, {"lora_name": "b", "lora_int_id": "one"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"
    r = post(srv, UNLOAD, {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."
    assert "b" in models(srv)


def test_concurrent_loads_of_one_name_one_wins(srv, adapters):
    results = []
    barrier = threading.Barrier(4)

    def load():
        barrier.wait()
        results.append(post(srv, LOAD, {"lora_name": "twice", "lora_path": adapters["a"]}))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 400, 400, 400], [r.text for r in results]
    assert all("already been loaded" in r.json()["error"]["message"]
               for r in results if r.status_code == 400)
    assert "twice" in models(srv)
    assert post(srv, UNLOAD, {"lora_name": "twice"}).status_code == 200


def test_metrics_show_the_adapter_while_it_runs_and_unload_lets_it_finish(srv, adapters):
    assert post(srv, LOAD, {"lora_name": "slow", "lora_path": adapters["a"]}).status_code == 200
    answer = {}

    def run():  # "__slow__": 0.05 s a step, so 60 tokens take 3 s at least
        answer["r"] = post(srv, "/v1/completions", {
            "model": "slow", "prompt": "__slow__ go", "max_tokens": 60, "temperature": 0,
            "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while True:
        samples = metrics_of(srv)
        try:
            running = metric(samples, "quire:lora_requests_running", adapter="slow")
        except KeyError:
            running = 0
        if running == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert running == 1
    assert metric(samples, "quire:lora_requests_waiting", adapter="slow") == 0
    loaded = sum(m["parent"] is not None for m in models(srv).values())  # b and slow
    assert loaded >= 2 and metric(samples, "quire:lora_adapters_loaded") == loaded
    info = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert len(info) == 1 and info[0]["running_lora_adapters"] == "slow"
    assert info[0]["max_lora"] == "2" and info[0]["waiting_lora_adapters"] == ""
    assert metric(samples, "vllm:lora_requests_info") > time.time() - 60  # a timestamp

    # unloaded while it runs: it still finishes, whole; new requests get 404
    assert post(srv, UNLOAD, {"lora_name": "slow"}).status_code == 200
    r = post(srv, "/v1/completions", {"model": "slow", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    t.join(60)
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 60
    samples = wait_idle(srv)
    assert metric(samples, "quire:kv_cache_blocks_used") == 0
    assert metric(samples, "quire:lora_adapters_loaded") == loaded - 1
    assert not [labels for (name, labels) in samples
                if name == "quire:lora_requests_running" and ("adapter", "slow") in labels]
    info = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert info == [{"max_lora": "2", "running_lora_adapters": "",
                     "waiting_lora_adapters": ""}]


def test_static_adapters_without_runtime_endpoints(servers, adapters, reference):
    srv = servers["static"]
    listed = models(srv, {})
    assert listed["a"]["parent"] == BASE and listed["a"]["root"] == adapters["a"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    assert completions(client, "a") == reference["a"][:len(PROMPTS)]
    assert chat(client, "a", stream=True) == reference["a"][-1]
    for path, body in ((LOAD, {"lora_name": "x", "lora_path": adapters["b"]}),
                       (UNLOAD, {"lora_name": "a"})):
        assert post(srv, path, body, {}).status_code == 404
    assert "a" in models(srv, {}) and "x" not in models(srv, {})
    # no --metrics-compat: our names, plus vLLM's LoRA info (routers read it), and no other
    samples = wait_idle(srv)
    assert metric(samples, "quire:lora_adapters_loaded") == 1
    assert {n for (n, _) in samples if n.startswith("vllm:")} == {"vllm:lora_requests_info"}
    info = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert info == [{"max_lora": "2", "running_lora_adapters": "",
                     "waiting_lora_adapters": ""}]


def test_no_kv_block_left_in_use(servers):
    for srv in servers.values():
        assert metric(wait_idle(srv), "quire:kv_cache_blocks_used") == 0
    assert not servers["runtime"].error_lines()


def test_responses_and_messages_pick_the_adapter_by_model(srv, reference):
    """/v1/responses and /v1/messages serve an adapter named by `model` as chat does: the
    greedy answer to CHAT is the adapter's reference, not the base model's."""
    r = post(srv, "/v1/responses", {"model": "b", "input": CHAT, "temperature": 0,
                                    "max_output_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "b"
    assert r.json()["output"][0]["content"][0]["text"] == reference["b"][-1]
    m = post(srv, "/v1/messages", {"model": "b", "messages": CHAT, "temperature": 0,
                                   "max_tokens": MAX_TOKENS}, headers={"x-api-key": API_KEY})
    assert m.status_code == 200, m.text
    assert m.json()["content"][0]["text"] == reference["b"][-1] != reference[None][-1]
    m = post(srv, "/v1/messages", {"model": "no-such-adapter", "messages": CHAT,
                                   "max_tokens": 2})
    assert m.status_code == 404 and m.json()["error"]["type"] == "not_found_error"
