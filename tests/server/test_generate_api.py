"""/generate as vLLM's notes use it (NUL-separated JSON chunks holding the text so far), and
/tokenize, /detokenize, /version."""

from __future__ import annotations

import json

import pytest
import requests

import quire
from quire import SamplingParams

from server_harness import reference_llm, server


@pytest.fixture(scope="module")
def srv():
    return server("smollm")


@pytest.fixture(scope="module")
def llm():
    return reference_llm()


def test_generate_streams_growing_text_split_on_nul(srv, llm, capsys):
    expected = llm.generate("Hello, ", SamplingParams(temperature=0, max_tokens=32),
                            use_tqdm=False)[0].outputs[0].text

    # The client from the notes, verbatim but for the URL and a greedy temperature.
    url = srv.url + "/generate"
    params = {"prompt": "Hello, ", "stream": True, "max_tokens": 32, "temperature": 0}
    resp = requests.post(url, json=params, stream=True)

    texts = []
    prev = ""
    for chunk in resp.iter_lines(delimiter=b"\0"):
        if not chunk:
            continue
        text: str = json.loads(chunk)["text"][0]
        texts.append(text)

        text = text.replace(prev, "")
        print(end=text, flush=True)
        prev += text

    print()
    assert resp.status_code == 200
    assert len(texts) > 5
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(set(texts)) >= len(texts) - 1  # every chunk but perhaps the last adds text
    assert texts[0].startswith("Hello, ")
    assert texts[-1] == "Hello, " + expected
    assert capsys.readouterr().out == "Hello, " + expected + "\n"


def test_generate_whole_answer(srv, llm):
    expected = llm.generate("hello, ", SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0].text
    r = requests.post(srv.url + "/generate", json={"prompt": "hello, ", "temperature": 0})
    assert r.status_code == 200
    assert r.json() == {"text": ["hello, " + expected]}  # max_tokens defaults to 16
    r = requests.post(srv.url + "/generate", json={"prompt": "hello, ", "n": 2,
                                                   "temperature": 1.0, "seed": 5})
    texts = r.json()["text"]
    assert len(texts) == 2 and all(t.startswith("hello, ") for t in texts)


def test_generate_stream_with_n(srv):
    resp = requests.post(srv.url + "/generate", stream=True,
                         json={"prompt": "Hi", "n": 2, "stream": True, "max_tokens": 8,
                               "seed": 1})
    chunks = [json.loads(c)["text"] for c in resp.iter_lines(delimiter=b"\0") if c]
    assert all(len(t) == 2 for t in chunks)
    assert all(t.startswith("Hi") for t in chunks[-1])


def test_tokenize_detokenize_version(srv, llm):
    ids = llm.tokenizer("Hello world, how are you?").input_ids
    r = requests.post(srv.url + "/tokenize", json={"prompt": "Hello world, how are you?"})
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    r = requests.post(srv.url + "/tokenize", json={"prompt": "Hello world, how are you?",
                                                   "return_token_strs": True})
    assert r.json()["token_strs"] == llm.tokenizer.convert_ids_to_tokens(ids)  # vLLM's field
    r = requests.post(srv.url + "/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": "Hello world, how are you?"}
    messages = [{"role": "user", "content": "Hi there"}]
    r = requests.post(srv.url + "/tokenize", json={"messages": messages})
    assert r.json()["tokens"] == llm.apply_chat_template(messages)
    assert requests.get(srv.url + "/version").json() == {"version": quire.__version__}
