"""The official openai client against `quire serve` on the default model: completions, chat,
streaming, n > 1, logprobs, echo, stop, usage. Greedy text must equal LLM.generate's."""

from __future__ import annotations

import pytest
from smollm_fixtures import client, llm, srv  # noqa: F401 (fixtures)

from quire import SamplingParams

from server_harness import SMOLLM_NAME, server

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [SMOLLM_NAME]


def test_completions_greedy_equals_llm_generate(client, llm, greedy):
    for prompt, ref in zip(PROMPTS, greedy):
        r = client.completions.create(model=SMOLLM_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert r.object == "text_completion" and r.model == SMOLLM_NAME
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(llm.tokenizer(prompt).input_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_batch_of_prompts_and_token_ids(client, llm, greedy):
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [g.text for g in greedy]
    ids = llm.tokenizer(PROMPTS[0]).input_ids
    r = client.completions.create(model=SMOLLM_NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == greedy[0].text
    assert r.usage.prompt_tokens == len(ids)


def test_completions_stream_with_usage(client, greedy):
    chunks = list(client.completions.create(
        model=SMOLLM_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 3  # it streamed, token by token
    assert "".join(texts) == greedy[1].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == greedy[1].finish_reason and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(greedy[1].token_ids)


def test_completions_n_and_seed_match_llm(client, llm):
    params = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=12)
    ref = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[0], n=3, temperature=0.9,
                                  seed=1234, max_tokens=12)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    got = {c.index: c.text for c in r.choices}
    assert got == {c.index: c.text for c in ref.outputs}
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    # the same, streamed: each choice's deltas add up to the same text
    text = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[0], n=3,
                                           temperature=0.9, seed=1234, max_tokens=12,
                                           stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
    assert text == got


def test_completions_logprobs_match_llm(client, llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    ref = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[0], max_tokens=8,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for tid, entry, got, top in zip(ref.token_ids, ref.logprobs, lp.token_logprobs,
                                    lp.top_logprobs):
        assert got == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert len(top) == 3  # greedy: the chosen token is one of the top 3
        assert max(top.values()) == pytest.approx(got, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completions_echo_and_stop(client, llm, greedy):
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + greedy[0].text
    stop = greedy[0].text.strip().split()[1]  # a word from the middle of the answer
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop=[stop]), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].text == ref.text


def test_completions_extra_sampling_parameters(client, llm):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 4,
             "ignore_eos": True, "stop_token_ids": [13]}
    ref = llm.generate(PROMPTS[2], SamplingParams(temperature=0.7, seed=7, max_tokens=10,
                                                  **extra), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=SMOLLM_NAME, prompt=PROMPTS[2], temperature=0.7,
                                  seed=7, max_tokens=10, extra_body=extra)
    assert r.choices[0].text == ref.text


def test_chat_greedy_equals_llm_chat(client, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                   use_tqdm=False)[0]
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=CHAT, temperature=0,
                                       max_tokens=MAX_TOKENS)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert "Paris" in msg.content
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_role_first_then_content_and_usage(client, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                   use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(
        model=SMOLLM_NAME, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_n_and_logprobs(client):
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=CHAT, n=2, temperature=1.0,
                                       seed=3, max_tokens=6, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_tokenizer_info_is_vllms_and_off_unless_enabled(srv):
    """What lm-eval's remote tokenizer reads: the tokenizer's class, special tokens and chat
    template; a server without --enable-tokenizer-info-endpoint answers 404, as vLLM does."""
    import requests

    from server_harness import runtime_helpers
    tokenizer = runtime_helpers().smollm2_tokenizer()
    info = requests.get(srv.url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert "vocab_file" not in info and "merges_file" not in info
    tiny = server("tiny")
    assert requests.get(tiny.url + "/tokenizer_info", headers=tiny.headers,
                        timeout=30).status_code == 404
