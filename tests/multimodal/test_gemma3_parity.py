"""Gemma 3 with images through Quire against transformers (float32 greedy, the processor's
own inputs, token_type_ids and all): one and two images per prompt and a text-only prompt;
a step budget that would cut through an image's run (and never does); preemption by
recompute; prefix-cache hits, one of which ends inside an image's run; and the bidirectional
attention shown to matter (a causal mask gives other logits)."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.multimodal.image_attention import image_runs
from quire.validation import QuireValidationError

from gemma3_helpers import BOI, TOKENS_PER_IMAGE
from mm_helpers import hf_greedy_mm, random_image

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
BLOCK = 16
# (text, image seeds); None: a text-only prompt
CASES = [
    (f"Describe {BOI} now.", [0]),
    (f"Describe {BOI} now.", [1]),
    (f"Compare {BOI} with {BOI} please, and say which is brighter.", [2, 3]),
    (f"{BOI}{BOI}", [4, 5]),
    ("A long preamble before the image, so that the image starts past the first KV block "
     f"of sixteen tokens: {BOI} and then text after it.", [6]),
    ("No image here at all, just some text to continue.", None),
]
SIZES = {0: (40, 32), 1: (64, 64), 2: (90, 50), 3: (30, 70), 4: (56, 56), 5: (120, 80),
         6: (33, 47)}
NUM_IMAGES = len(SIZES)


def prompts():
    return [text if seeds is None else
            {"prompt": text, "multi_modal_data": {"image": [random_image(s, SIZES[s])
                                                            for s in seeds]}}
            for text, seeds in CASES]


def hf_inputs(processor, prompt):
    if isinstance(prompt, str):
        return processor(text=prompt, return_tensors="pt")
    return processor(text=prompt["prompt"], images=prompt["multi_modal_data"]["image"],
                     return_tensors="pt")


@pytest.fixture(scope="module")
def reference(gemma3_oracle):
    model, processor = gemma3_oracle
    out = []
    for p in prompts():
        images = None if isinstance(p, str) else p["multi_modal_data"]["image"]
        out.append(hf_greedy_mm(model, processor, p if images is None else p["prompt"],
                                images, MAX_NEW))
    assert out[0] != out[1]  # the same text with another image: the image matters
    return out


def run(llm: LLM, batch) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    """Every KV block returned and every image's pixels let go once all requests ended."""
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert llm.engine.executor.multimodal.num_pending == 0


def record_chunks(llm: LLM) -> list[tuple[int, list]]:
    """Each step's (tokens, prefill chunks), as the executor receives them."""
    steps, execute = [], llm.engine.executor.execute

    def recording(out):
        chunks = out.batch.chunks if not out.empty else []
        steps.append((sum(len(c.token_ids) for c in chunks), list(chunks)))
        return execute(out)

    llm.engine.executor.execute = recording
    return steps


@pytest.mark.parametrize("budget", [2048, 18])
def test_greedy_matches_transformers(gemma3_path, reference, budget):
    """18 tokens a step: without the rule, prefill chunks would end inside the 16-token runs
    (the first prompt's [0, 18) in its run [3, 19)); with it, a chunk ends before the run and
    the next one holds all of it."""
    llm = LLM(gemma3_path, dtype="float32", max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    steps = record_chunks(llm)
    assert run(llm, prompts()) == reference
    # each image prompt's run starts, by prompt length (prompts 0 and 1 share theirs)
    starts = {}
    for p in prompts():
        if not isinstance(p, str):
            mm = llm.engine.mm_processor.process(p["prompt"], p["multi_modal_data"]["image"])
            starts[len(mm.token_ids)] = {im.offset for im in mm.images}
    cut_before_a_run = False
    for total, chunks in steps:
        for c in chunks:
            end = c.start + len(c.token_ids)
            for lo, hi in image_runs(c.images):
                assert not lo < end < hi, f"chunk [{c.start}, {end}) ends inside [{lo}, {hi})"
            # ended right before a run with budget left over: the rule cut it
            cut_before_a_run |= (total < budget and end < c.num_prompt_tokens
                                 and end in starts.get(c.num_prompt_tokens, ()))
    assert cut_before_a_run == (budget == 18)
    assert llm.engine.snapshot().encoder_cache["misses"] == NUM_IMAGES
    assert_clean(llm)


def test_one_prompt_at_a_time(gemma3_path, reference):
    llm = LLM(gemma3_path, dtype="float32", max_num_batched_tokens=20)
    assert [run(llm, [p])[0] for p in prompts()] == reference
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_brings_the_images_back(gemma3_path, reference, mode):
    """A KV cache of 8 blocks for prompts of 1 to 4 blocks each: sequences are preempted and
    come back, by recompute (their prompts, images and all, computed again) or by swap
    (their blocks back from the host)."""
    block_bytes = 2 * 4 * BLOCK * 2 * 16 * 4  # K and V, 4 layers, 2 heads of 16, fp32
    llm = LLM(gemma3_path, dtype="float32", max_num_batched_tokens=24,
              kv_cache_memory=8 * block_bytes, enable_prefix_caching=False,
              preemption_mode=mode, swap_space=32 * block_bytes if mode == "swap" else 0)
    assert run(llm, prompts() * 2) == reference * 2
    assert llm.engine.snapshot().preemptions.get(mode, 0) > 0
    assert_clean(llm)


def one(llm, text, image):
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_prefix_cache_hits_and_no_false_hit(gemma3_path, gemma3_oracle):
    """A, then B under the same text (no block over an image is shared), then A again (a
    hit over A's image's blocks)."""
    model, processor = gemma3_oracle
    text = ("A question that takes more than one block of sixteen tokens before the "
            f"picture: {BOI} what is it?")
    a, b = random_image(10), random_image(11)
    ids = processor(text=text, images=[a], return_tensors="pt")["input_ids"][0].tolist()
    offset = ids.index(model.config.image_token_id)
    assert offset >= BLOCK  # the first block holds text only
    llm = LLM(gemma3_path, dtype="float32", enable_prefix_caching=True,
              max_num_batched_tokens=40)

    out_a, cached_a = one(llm, text, a)
    assert out_a == hf_greedy_mm(model, processor, text, [a], 8) and cached_a == 0
    out_b, cached_b = one(llm, text, b)
    assert out_b == hf_greedy_mm(model, processor, text, [b], 8) and out_b != out_a
    assert cached_b == offset // BLOCK * BLOCK  # the text-only blocks before the image
    out_a2, cached_a2 = one(llm, text, a)
    assert out_a2 == out_a and cached_a2 > offset  # blocks over A's run hit
    assert_clean(llm)


def test_a_hit_that_ends_inside_an_image_run_sees_the_whole_run(gemma3_path, gemma3_oracle):
    """The second prompt shares the first's blocks up to a boundary inside the image's run:
    its first chunk starts mid-run, its rows of the run look back at the cached ones and
    ahead to the run's end, as in transformers' one forward over the whole prompt."""
    model, processor = gemma3_oracle
    image = random_image(12, (64, 48))
    first = f"Some words here: {BOI} end."
    second = f"Some words here: {BOI} and then a different, longer ending."
    ids = processor(text=second, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    offset = ids.index(model.config.image_token_id)
    llm = LLM(gemma3_path, dtype="float32", enable_prefix_caching=True,
              max_num_batched_tokens=64)
    one(llm, first, image)
    out, cached = one(llm, second, image)
    assert offset < cached < offset + TOKENS_PER_IMAGE  # the hit ends inside the run
    assert out == hf_greedy_mm(model, processor, second, [image], 8)
    assert_clean(llm)


def test_bidirectional_attention_over_images_matters(gemma3_path, gemma3_oracle):
    """The first token's logprobs equal transformers' (token_type_ids given: each image's run
    attends both ways) and differ from a causal forward's, which Quire gives when its runner
    drops the key limits: so a causal mask could not pass the parity tests by chance."""
    model, processor = gemma3_oracle
    prompt = prompts()[2]
    inputs = hf_inputs(processor, prompt)
    with torch.no_grad():
        bidirectional = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
        causal_inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        causal = torch.log_softmax(model(**causal_inputs).logits[0, -1].float(), -1)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    llm = LLM(gemma3_path, dtype="float32", enable_prefix_caching=False)

    def ours():
        top = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]
        return {t: lp.logprob for t, lp in top.items()}

    got = ours()
    for t, lp in got.items():
        assert abs(lp - bidirectional[t].item()) < 1e-4
    assert max(abs(bidirectional[t] - causal[t]).item() for t in got) > 1e-2
    llm.engine.executor.runner.mm_bidirectional = False  # as if the mask were causal
    causal_got = ours()
    for t, lp in causal_got.items():
        assert abs(lp - causal[t].item()) < 1e-4
    assert_clean(llm)


def test_a_step_budget_smaller_than_an_image_is_refused_at_start_up(gemma3_path):
    with pytest.raises(QuireValidationError, match="max_num_batched_tokens must be >= 16") \
            as err:
        LLM(gemma3_path, dtype="float32", max_num_batched_tokens=12)
    assert err.value.field == "max_num_batched_tokens"


def test_chat_with_an_image_part(gemma3_path, gemma3_oracle):
    """A chat message's image part: the processor's template writes the begin-of-image
    token, the processor expands it; the reply is transformers' on the same text."""
    model, processor = gemma3_oracle
    image = random_image(13, (50, 60))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]}]
    llm = LLM(gemma3_path, dtype="float32")
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    assert text.count(BOI) == 1
    inputs = processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        gen = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert out == gen[0, inputs["input_ids"].shape[1]:].tolist()
    assert_clean(llm)
