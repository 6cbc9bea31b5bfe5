"""A request must never look done when it is not (issue 49, item 2): penalties at the edge of
their range keep the sampler's arithmetic finite (the issue's request: a repetition penalty
of float32's smallest normal under a guided choice answered 200 with finish_reason "error"
and no text), and a sequence the engine fails with no message of its own (a grammar refusing
its token) answers 500 with a message, or an error event in a stream, never a 200."""

from __future__ import annotations

import openai
import pytest
import requests

from server_harness import SMOLLM_NAME, openai_client, server

TINY_PENALTY = 1.1754943508222875e-38  # float32's smallest normal


@pytest.fixture(scope="module")
def smollm():
    return server("smollm")


def test_the_issues_request_answers_the_choice(smollm):
    client = openai_client(smollm)
    r = client.completions.create(
        model=SMOLLM_NAME, prompt="abc def abc def", max_tokens=8,
        extra_body={"guided_choice": ["abc def"], "repetition_penalty": TINY_PENALTY})
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason) == ("abc def", "stop")


@pytest.mark.parametrize("penalty", [TINY_PENALTY, 1e30])
def test_extreme_repetition_penalties_decode_finite_text(smollm, penalty):
    client = openai_client(smollm)
    r = client.completions.create(
        model=SMOLLM_NAME, prompt="abc def abc def", max_tokens=8, temperature=1.0, seed=1,
        extra_body={"repetition_penalty": penalty, "ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].text.strip()


@pytest.mark.parametrize("penalty", [0, -1.0])
def test_repetition_penalty_out_of_range_is_400_naming_it(smollm, penalty):
    r = requests.post(smollm.url + "/v1/completions", timeout=60,
                      json={"prompt": "abc", "max_tokens": 2, "repetition_penalty": penalty})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_a_sequence_failed_in_the_engine_is_a_500_not_a_200():
    fault = server("fault")  # "__reject__": its token is refused as a grammar refuses one
    client = openai_client(fault)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=fault.args[0], prompt="__reject__ x", max_tokens=4)
    assert "failed in the engine" in caught.value.body["message"]
    with pytest.raises(openai.APIError) as caught:  # streamed: an error event ends it
        for _ in client.completions.create(model=fault.args[0], prompt="__reject__ y",
                                           max_tokens=4, stream=True):
            pass
    assert "failed in the engine" in str(caught.value)
    r = client.completions.create(model=fault.args[0], prompt="fine", max_tokens=3)
    assert r.choices[0].finish_reason == "length"  # the server goes on
