"""Images and the two caches: the prefix cache (the image's hash is in the hashes of the
blocks its placeholders lie in) and the encoder cache (embeddings by image hash).

Image A, then image B with the same text (no false hit: B's output is transformers' own and
no block over the image is shared), then A again (a true hit: blocks over A's image are
cached), then A under another text (the encoder cache serves A: a hit, no new miss)."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams

from mm_helpers import hf_greedy_mm, random_image

GREEDY = SamplingParams(temperature=0, max_tokens=8)
BLOCK = 16
# 20-odd text tokens before the image: the first block is text only, the next hold the image
TEXT = ("USER: a question that takes more than one block of sixteen tokens before the "
        "picture: <image>\nwhat is it? ASSISTANT:")
OTHER_TEXT = "USER: <image>\nand now? ASSISTANT:"


@pytest.fixture(scope="module")
def llm(llava_path):
    return LLM(llava_path, dtype="float32", enable_prefix_caching=True,
               max_num_batched_tokens=40)


def placeholder_offset(processor, model, text, image) -> int:
    ids = processor(text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    return ids.index(model.config.image_token_index)


def one(llm, text, image):
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY,
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_same_text_other_image_never_hits_the_image_blocks(llm, hf_oracle):
    model, processor = hf_oracle
    a, b = random_image(10), random_image(11)
    image_offset = placeholder_offset(processor, model, TEXT, a)
    assert image_offset >= BLOCK  # the first block holds text only
    cache = llm.engine.executor.multimodal.cache

    out_a, cached_a = one(llm, TEXT, a)
    assert out_a == hf_greedy_mm(model, processor, TEXT, [a], 8)
    assert cached_a == 0

    out_b, cached_b = one(llm, TEXT, b)
    assert out_b == hf_greedy_mm(model, processor, TEXT, [b], 8)
    assert out_b != out_a
    # the text-only blocks before the image are shared; none that holds a placeholder is
    assert cached_b == image_offset // BLOCK * BLOCK

    out_a2, cached_a2 = one(llm, TEXT, a)
    assert out_a2 == out_a
    assert cached_a2 > image_offset  # blocks over A's placeholders hit

    misses = cache.misses
    hits = cache.hits
    out_other, _ = one(llm, OTHER_TEXT, a)
    assert out_other == hf_greedy_mm(model, processor, OTHER_TEXT, [a], 8)
    assert cache.misses == misses and cache.hits == hits + 1  # A's embeddings, cached
    assert llm.engine.snapshot().encoder_cache["hits"] == cache.hits
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert llm.engine.executor.multimodal.num_pending == 0


def test_a_hit_that_ends_inside_an_image_takes_the_rest_of_its_rows(llm, hf_oracle):
    """The same image and text up to a point inside the image's run: the hit covers the
    blocks before the cut and the chunk after it starts mid-image."""
    model, processor = hf_oracle
    image = random_image(12, (64, 48))
    first = "USER: some words, then <image> then the first ending. ASSISTANT:"
    second = "USER: some words, then <image> then another ending entirely. ASSISTANT:"
    one(llm, first, image)
    out, cached = one(llm, second, image)
    offset = placeholder_offset(processor, model, second, image)
    assert offset < cached < offset + 16  # the hit ends inside the placeholder run
    assert out == hf_greedy_mm(model, processor, second, [image], 8)
