"""A prompt that ends inside its last message, for the answer to continue: vLLM's
continue_final_message (chat completions, /tokenize, LLM.chat) and chat's echo, and the
Messages API's final assistant turn (Anthropic's prefill), on the default model; the prompt is
transformers' apply_chat_template(continue_final_message=True), the answer LLM.chat's greedy
one; a request's own template (rendered in the sandbox) gives the same prompt; bad
combinations are 400s naming the field."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from smollm_fixtures import client, llm, srv  # noqa: F401 (fixtures)

from quire import SamplingParams
from quire.models.loader import load_tokenizer, materialize, resolve_model

from server_harness import API_KEY, SMOLLM_NAME, server, tiny_model

STARTED = [{"role": "user", "content": "Count from 1 to 20, separated by commas."},
           {"role": "assistant", "content": "1, 2, 3, 4,"}]
MAX = 12
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def expected(llm):
    """(prompt ids, greedy answer) of STARTED continued, through transformers and LLM.chat."""
    ids = list(llm.tokenizer.apply_chat_template(STARTED, tokenize=True, return_dict=False,
                                                 **CONTINUE))
    out = llm.chat(STARTED, SamplingParams(temperature=0, max_tokens=MAX), use_tqdm=False,
                   **CONTINUE)[0]
    assert out.prompt_token_ids == ids
    return ids, out.outputs[0].text


def test_the_prompt_ends_inside_the_last_message(llm, expected, srv):
    ids, text = expected
    assert llm.tokenizer.decode(ids).endswith("assistant\n1, 2, 3, 4,")
    assert text.startswith(" 5, 6")  # it goes on counting, not a new turn
    r = requests.post(srv.url + "/tokenize", json={"messages": STARTED, **CONTINUE}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids


def test_chat_completion_continues_the_final_message(client, expected):
    ids, text = expected
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=STARTED, max_tokens=MAX,
                                       temperature=0, extra_body=CONTINUE)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids)


def test_echo_puts_the_assistants_last_message_first(client, expected):
    _, text = expected
    whole = "1, 2, 3, 4," + text
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=STARTED, max_tokens=MAX,
                                       temperature=0, extra_body={**CONTINUE, "echo": True})
    assert r.choices[0].message.content == whole
    stream = client.chat.completions.create(model=SMOLLM_NAME, messages=STARTED,
                                            max_tokens=MAX, temperature=0, stream=True,
                                            extra_body={**CONTINUE, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    # a last message of the user's is not the answer's: nothing echoed
    plain = client.chat.completions.create(model=SMOLLM_NAME, messages=STARTED[:1],
                                           max_tokens=4, temperature=0,
                                           extra_body={"echo": True})
    again = client.chat.completions.create(model=SMOLLM_NAME, messages=STARTED[:1],
                                           max_tokens=4, temperature=0)
    assert plain.choices[0].message.content == again.choices[0].message.content


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"messages": STARTED, "continue_final_message": True},
     "add_generation_prompt must be false"),
    ("/tokenize", {"messages": STARTED, "continue_final_message": True},
     "add_generation_prompt must be false"),
    ("/v1/chat/completions", {"messages": [STARTED[0], {"role": "assistant", "content": []}],
                              **CONTINUE}, "has no text part"),
])
def test_a_continuation_that_cannot_be_is_a_400_naming_it(srv, path, body, words):
    r = requests.post(srv.url + path, json={"max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "continue_final_message" and words in error["message"]


def test_messages_api_continues_a_final_assistant_turn(srv, expected):
    ids, text = expected
    aclient = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                  timeout=300)
    m = aclient.messages.create(model=SMOLLM_NAME, max_tokens=MAX, messages=STARTED,
                                extra_body={"temperature": 0})
    assert "".join(b.text for b in m.content if b.type == "text") == text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    blocks = [{"role": "user", "content": STARTED[0]["content"]},
              {"role": "assistant", "content": [{"type": "text", "text": "1, 2, 3, 4,"}]}]
    assert aclient.messages.count_tokens(model=SMOLLM_NAME, messages=blocks).input_tokens \
        == len(ids)
    with pytest.raises(anthropic.BadRequestError) as err:
        aclient.messages.create(model=SMOLLM_NAME, max_tokens=MAX, messages=[
            STARTED[0], {"role": "assistant", "content": "1, 2, 3, 4, "}])
    assert "trailing whitespace" in str(err.value) and "messages[1].content" in str(err.value)


def test_a_requests_own_template_continues_alike():
    """The sandboxed renderer tags and cuts as transformers does: the same prompt ids."""
    srv = server("tiny")
    tokenizer = load_tokenizer(materialize(resolve_model(tiny_model())), None)
    ids = list(tokenizer.apply_chat_template(STARTED, tokenize=True, return_dict=False,
                                             **CONTINUE))
    body = {"messages": STARTED, "max_tokens": 2, "temperature": 0, "stream": True,
            "return_token_ids": True, "chat_template": tokenizer.chat_template, **CONTINUE}
    with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    firsts = [c["choices"][0] for c in chunks if c["choices"] and "prompt_token_ids" in
              c["choices"][0]]
    assert firsts and firsts[0]["prompt_token_ids"] == ids


@pytest.mark.parametrize("field,value", [("conversation", "conv_123"),
                                         ("prompt", {"id": "pmpt_123"})])
def test_responses_refuses_hosted_state_it_does_not_keep(srv, field, value):
    r = requests.post(srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                                       field: value}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
