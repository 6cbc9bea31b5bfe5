"""Embeddings on the pooling runner against sentence-transformers float32, on a tiny random
Qwen3 embedding checkpoint that sentence-transformers wrote (its modules.json, last-token
Pooling, Normalize, default prompt, matryoshka dimensions): offline (LLM.embed, prefilled in
16-token chunks, no block kept after) and over HTTP (/v1/embeddings through the official
openai client, base64 and float, dimensions; /score and /rerank), with the 400s for the
wrong runner and bad input. `--convert embed` turns a generation checkpoint into one."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch

from quire import LLM, PoolingParams, QuireValidationError, SamplingParams

from embedding_model import QUERY_PROMPT, save_embedding_model, sentence_transformer
from runtime_helpers import assert_no_blocks_in_use
from scoring_server import running_server, scoring_server_args
from server_harness import openai_client, runtime_helpers

TOL = 1e-4
TEXTS = ["hello world", "x", "Paris is the capital of France. " * 6,
         "a passage about paged attention and continuous batching in serving engines"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_embedding_model(str(tmp_path_factory.mktemp("embed") / "qwen3-embedding"))


@pytest.fixture(scope="module")
def st(model_path):
    return sentence_transformer(model_path)


def _close(ours, theirs) -> None:
    ours = torch.tensor(ours, dtype=torch.float32)  # (a copy: base64 decodes to a read-only array)
    theirs = torch.as_tensor(theirs)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < TOL


def test_llm_embed_matches_sentence_transformers(model_path, st):
    llm = LLM(model_path, runner="pooling", dtype="float32", kv_cache_memory=8 << 20,
              max_num_batched_tokens=16)
    outs = llm.embed(TEXTS, use_tqdm=False)
    ref = st.encode(TEXTS, convert_to_tensor=True)  # with its default (query) prompt
    for out, r in zip(outs, ref):
        _close(out.outputs.embedding, r)
    assert outs[0].prompt_token_ids == llm.tokenizer(QUERY_PROMPT + TEXTS[0]).input_ids
    # matryoshka: the first 32 dimensions, renormalized
    cut = llm.embed(TEXTS, PoolingParams(dimensions=32), use_tqdm=False)
    ref32 = st.encode(TEXTS, convert_to_tensor=True, truncate_dim=32)
    for out, r in zip(cut, ref32):
        _close(out.outputs.embedding, torch.nn.functional.normalize(r, dim=-1))
    assert_no_blocks_in_use(llm)  # prefill only: every block back at once
    with pytest.raises(QuireValidationError) as e:
        llm.embed(TEXTS, PoolingParams(dimensions=20))  # not one of its dimensions
    assert e.value.field == "dimensions"
    with pytest.raises(QuireValidationError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=2))
    assert e.value.field == "runner"
    # an input may fill the context (nothing is generated after it), not one token more
    limit = min(llm.engine.max_model_len, llm.engine.capacity_tokens)
    (full,) = llm.embed([{"prompt_token_ids": [11] * limit}], use_tqdm=False)
    assert len(full.prompt_token_ids) == limit
    with pytest.raises(QuireValidationError, match=f"at most {limit} tokens"):
        llm.embed([{"prompt_token_ids": [11] * (limit + 1)}], use_tqdm=False)
    assert_no_blocks_in_use(llm)


def test_convert_embed_serves_a_generation_checkpoint(tmp_path):
    """--convert embed on a LlamaForCausalLM: its normalized last-token hidden state."""
    import transformers
    helpers = runtime_helpers()
    path = helpers.save_tiny_model(str(tmp_path / "llama"), helpers.tiny_config("llama"),
                                   helpers.smollm2_tokenizer())
    llm = LLM(path, convert="embed", dtype="float32", kv_cache_memory=8 << 20)
    prompt = helpers.random_prompts(lengths=[40], seed=2)[0]
    out = llm.embed([prompt], use_tqdm=False)[0]
    base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        hidden = base(torch.tensor([prompt])).last_hidden_state[0, -1]
    _close(out.outputs.embedding, torch.nn.functional.normalize(hidden, dim=-1))
    with pytest.raises(QuireValidationError) as e:
        LLM(path, dtype="float32", kv_cache_memory=8 << 20).embed(["hi"])
    assert e.value.field == "runner"


@pytest.fixture(scope="module")
def servers(model_path):
    """(the pooling server of the embedding model, a generation server)."""
    with running_server("embed", [model_path, "--runner", "pooling", "--dtype", "float32",
                                  "--kv-cache-memory", "16M", "--num-threads", "1",
                                  "--max-num-batched-tokens", "16",
                                  "--served-model-name", "embedder"]) as pooled, \
            running_server("generate-for-embed", scoring_server_args()) as gen:
        yield pooled, gen


def test_embeddings_through_the_openai_client(servers, st):
    """The official client asks for base64 and decodes it; float comes as numbers."""
    srv, _ = servers
    client = openai_client(srv)
    got = client.embeddings.create(model="embedder", input=TEXTS)
    ref = st.encode(TEXTS, convert_to_tensor=True)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, r in zip(got.data, ref):
        _close(d.embedding, r)
    assert got.usage.prompt_tokens > 0
    cut = client.embeddings.create(model="embedder", input=TEXTS[:2], dimensions=16)
    ref16 = st.encode(TEXTS[:2], convert_to_tensor=True, truncate_dim=16)
    for d, r in zip(cut.data, ref16):
        _close(d.embedding, torch.nn.functional.normalize(r, dim=-1))


def test_embeddings_float_base64_and_token_ids(servers, st, model_path):
    srv, _ = servers
    tokenizer = sentence_transformer(model_path).tokenizer
    ids = tokenizer(QUERY_PROMPT + TEXTS[2]).input_ids
    floats = requests.post(srv.url + "/v1/embeddings", json={
        "input": [ids], "encoding_format": "float"}, timeout=60).json()
    b64 = requests.post(srv.url + "/v1/embeddings", json={
        "input": [ids], "encoding_format": "base64"}, timeout=60).json()
    ref = st.encode([TEXTS[2]], convert_to_tensor=True)[0]
    _close(floats["data"][0]["embedding"], ref)
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    _close(decoded, ref)
    assert b64["usage"]["prompt_tokens"] == len(ids)


def test_embeddings_take_normalize_and_truncate_prompt_tokens(servers, st, model_path):
    """vLLM's normalize (false: the pooled vector as it is) and truncate_prompt_tokens (the
    prompt's last k tokens), both silently ignored before."""
    srv, _ = servers
    raw = requests.post(srv.url + "/v1/embeddings", timeout=60, json={
        "input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    unit = st.encode([TEXTS[0]], convert_to_tensor=True)[0]
    norm = float(np.linalg.norm(raw))
    assert abs(norm - 1.0) > 1e-3  # not a unit vector: the pooled one
    _close([x / norm for x in raw], unit)
    tokenizer = sentence_transformer(model_path).tokenizer
    ids = tokenizer(QUERY_PROMPT + TEXTS[2]).input_ids
    cut = requests.post(srv.url + "/v1/embeddings", timeout=60, json={
        "input": [ids], "truncate_prompt_tokens": 5}).json()
    whole = requests.post(srv.url + "/v1/embeddings", timeout=60, json={
        "input": [ids[-5:]]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["data"][0]["embedding"] == whole["data"][0]["embedding"]
    # completions keep the prompt's last tokens too (echo shows what was kept)
    _, gen = servers
    kept = requests.post(gen.url + "/v1/completions", timeout=60, json={
        "prompt": [5, 6, 7, 8, 9, 10], "truncate_prompt_tokens": 3, "max_tokens": 1,
        "echo": True, "temperature": 0}).json()
    again = requests.post(gen.url + "/v1/completions", timeout=60, json={
        "prompt": [8, 9, 10], "max_tokens": 1, "echo": True, "temperature": 0}).json()
    assert kept["usage"]["prompt_tokens"] == 3
    assert kept["choices"][0]["text"] == again["choices"][0]["text"]


def test_an_input_may_fill_the_context(servers):
    """Nothing is generated after a pooled input, so it may take the whole context (vLLM's
    check is > max_model_len); one token more is a 400 naming the input."""
    srv, _ = servers
    limit = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    full = requests.post(srv.url + "/v1/embeddings", timeout=120, json={
        "input": [[11] * limit]})
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["prompt_tokens"] == limit
    over = requests.post(srv.url + "/v1/embeddings", timeout=60, json={
        "input": [[11] * (limit + 1)]})
    assert over.status_code == 400 and f"at most {limit} tokens" in over.json()["error"]["message"]
    kept = requests.post(srv.url + "/v1/embeddings", timeout=120, json={
        "input": [[11] * (limit + 5)], "truncate_prompt_tokens": -1})
    assert kept.json()["usage"]["prompt_tokens"] == limit


def test_score_and_rerank_are_cosine_similarities(servers, st):
    srv, _ = servers
    query, docs = TEXTS[0], TEXTS[1:]
    emb = st.encode([query, *docs], convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(emb[:1], emb[1:]).tolist()
    r = requests.post(srv.url + "/score", json={"text_1": query, "text_2": docs}, timeout=60)
    assert r.status_code == 200, r.text
    assert all(abs(d["score"] - c) < TOL for d, c in zip(r.json()["data"], cos))
    r = requests.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs,
                                                    "top_n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    best = sorted(range(len(docs)), key=lambda i: -cos[i])[:2]
    assert [x["index"] for x in results] == best
    assert all(abs(x["relevance_score"] - cos[x["index"]]) < TOL for x in results)
    assert results[0]["document"]["text"] == docs[best[0]]


@pytest.mark.parametrize("which,path,body,param", [
    ("gen", "/v1/embeddings", {"input": "hi"}, "model"),
    ("gen", "/score", {"text_1": "a", "text_2": "b"}, "model"),
    ("pooled", "/v1/completions", {"prompt": "hi"}, "model"),
    ("pooled", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "model"),
    ("pooled", "/v1/embeddings", {"input": "hi", "dimensions": 20}, "dimensions"),
    ("pooled", "/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("pooled", "/v1/embeddings", {"input": "hi", "dimensions": "16"}, "dimensions"),
    ("pooled", "/v1/embeddings", {"input": "hi", "encoding_format": "int8"},
     "encoding_format"),
    ("pooled", "/v1/embeddings", {"input": []}, "input"),
    ("pooled", "/v1/embeddings", {"input": [""]}, "input"),
    ("pooled", "/v1/embeddings", {"input": [[10**9]]}, "input"),
    ("pooled", "/v1/embeddings", {"input": "hi " * 5000}, "input"),
    ("pooled", "/v1/embeddings", {}, "input"),
    ("pooled", "/v1/embeddings", {"input": "hi", "normalize": "yes"}, "normalize"),
    ("pooled", "/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("gen", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                     "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("gen", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, "messages"),
    ("pooled", "/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("pooled", "/score", {"text_1": "a", "text_2": ["b", "c " * 5000]}, "text_2"),
    ("pooled", "/rerank", {"query": "q " * 5000, "documents": ["d"]}, "query"),
    ("pooled", "/rerank", {"query": "q", "documents": []}, "documents"),
    ("pooled", "/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
])
def test_bad_pooling_input_is_a_400_naming_the_field(servers, which, path, body, param):
    pooled, gen = servers
    srv = pooled if which == "pooled" else gen
    r = requests.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
