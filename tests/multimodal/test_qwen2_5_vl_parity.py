"""Qwen2.5-VL through Quire against transformers (float32 greedy, the processor's own
inputs): images of several sizes and aspect ratios (so grids of several shapes, window and
full attention in the tower), one and two per prompt, a text-only prompt, chunks that cut
through an image's run, preemption by recompute, prefix-cache hits (whose next chunk starts
past an image, where M-RoPE positions run behind the token count), n-gram speculation, and
both checkpoint spellings."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams
from quire.validation import QuireValidationError

from mm_helpers import hf_greedy_mm, random_image
from qwen_vl_helpers import IMAGE

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
BLOCK = 16
# (text, image seeds)
CASES = [
    (f"USER: {IMAGE}\nWhat is in the picture? ASSISTANT:", [0]),
    (f"USER: {IMAGE}\nWhat is in the picture? ASSISTANT:", [1]),
    (f"USER: Compare {IMAGE} with {IMAGE} please. ASSISTANT:", [2, 3]),
    (f"{IMAGE}{IMAGE}", [4, 5]),   # two placeholder runs side by side
    ("A long preamble before the image, so that the image starts past the first KV block "
     f"of sixteen tokens: {IMAGE} and then text after it. ASSISTANT:", [6]),
    ("USER: a prompt without any image at all, text alone. ASSISTANT:", []),
]
# (width, height): grids of 8 x 10, 14 x 6, 4 x 4, 12 x 18 (54 tokens), 10 x 8, 6 x 14 and
# 12 x 8 patches; windows of 4 x 4 patches, some cut short at the grid's edge
SIZES = {0: (140, 112), 1: (84, 196), 2: (56, 56), 3: (300, 200), 4: (112, 140),
         5: (200, 90), 6: (170, 130)}


def prompt(text: str, seeds: list[int]):
    if not seeds:
        return text
    return {"prompt": text,
            "multi_modal_data": {"image": [random_image(s, SIZES[s]) for s in seeds]}}


def prompts():
    return [prompt(text, seeds) for text, seeds in CASES]


def hf_tokens(oracle, p, max_new: int = MAX_NEW) -> list[int]:
    model, processor = oracle
    if isinstance(p, str):
        return hf_greedy_mm(model, processor, p, [], max_new)
    return hf_greedy_mm(model, processor, p["prompt"], p["multi_modal_data"]["image"],
                        max_new)


@pytest.fixture(scope="module")
def reference(qwen_vl_oracle):
    out = [hf_tokens(qwen_vl_oracle, p) for p in prompts()]
    assert out[0] != out[1]  # the same text with another image: the image matters
    assert len({tuple(t) for t in out}) == len(out)
    return out


def run(llm: LLM, batch, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    """Every KV block returned and every image's pixels let go once all requests ended."""
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert llm.engine.executor.multimodal.num_pending == 0


@pytest.mark.parametrize("budget", [2048, 12])
def test_greedy_matches_transformers(qwen_vl_path, reference, budget):
    """12 tokens a step: prefill chunks cut through the placeholder runs (and through their
    M-RoPE triples), so a chunk takes a slice of an image's embeddings and positions."""
    llm = LLM(qwen_vl_path, dtype="float32", max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    assert run(llm, prompts()) == reference
    assert llm.engine.snapshot().encoder_cache["misses"] == len(SIZES)  # once, however cut
    assert_clean(llm)


def test_preemption_recomputes_images_and_positions(qwen_vl_path, reference):
    """A KV cache of 10 blocks for prompts of 1 to 5 blocks each: sequences are preempted
    and recomputed, their chunks running across the prompt's end into generated tokens."""
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 heads of 16, fp32
    llm = LLM(qwen_vl_path, dtype="float32", max_num_batched_tokens=24,
              kv_cache_memory=10 * block_bytes, enable_prefix_caching=False)
    assert run(llm, prompts() * 2) == reference * 2
    assert llm.engine.snapshot().preemptions.get("recompute", 0) > 0
    assert_clean(llm)


def test_prefix_hits_take_positions_from_the_request(qwen_vl_path, qwen_vl_oracle):
    """Image A, then B under the same text (no false hit), then A again (a hit past the
    image: the next chunk's triples run delta behind its token positions), then A under a
    text that parts from the first inside A's run (a hit that ends mid-image)."""
    llm = LLM(qwen_vl_path, dtype="float32", enable_prefix_caching=True,
              max_num_batched_tokens=40)
    model, processor = qwen_vl_oracle
    text = ("USER: a question that takes more than one block of sixteen tokens before the "
            f"picture: {IMAGE}\nwhat is it? Say it in a few words. ASSISTANT:")
    a, b = random_image(10, (300, 200)), random_image(11, (300, 200))  # 54 tokens each
    ids = processor(text=text, images=[a], return_tensors="pt")["input_ids"][0].tolist()
    offset = ids.index(model.config.image_token_id)
    assert offset >= BLOCK and len(ids) >= offset + 54 + BLOCK

    def one(text, image):
        out = llm.generate(prompt_of(text, image), GREEDY, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    out_a, cached = one(text, a)
    assert out_a == hf_greedy_mm(model, processor, text, [a], MAX_NEW) and cached == 0
    out_b, cached = one(text, b)
    assert out_b == hf_greedy_mm(model, processor, text, [b], MAX_NEW) != out_a
    assert cached == offset // BLOCK * BLOCK  # only the text blocks before the image
    out_a2, cached = one(text, a)
    assert out_a2 == out_a and cached >= offset + 54  # past A's run
    mid = text.replace(f"{IMAGE}\nwhat", f"{IMAGE}\nwhy")
    cut = ids.index(model.config.vision_end_token_id)  # the texts part after the run
    out_mid, cached = one(mid, a)
    assert out_mid == hf_greedy_mm(model, processor, mid, [a], MAX_NEW)
    assert offset < cached <= cut
    assert_clean(llm)


def prompt_of(text, image):
    return {"prompt": text, "multi_modal_data": {"image": [image]}}


def test_ngram_speculation_keeps_the_tokens(qwen_vl_path, qwen_vl_oracle):
    """Verification rows lie past the prompt: each has its three positions = p + delta."""
    llm = LLM(qwen_vl_path, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2})
    batch = prompts()[:3] + prompts()[4:]
    params = SamplingParams(temperature=0, max_tokens=24)
    assert run(llm, batch, params) == [hf_tokens(qwen_vl_oracle, p, 24) for p in batch]
    assert llm.engine.speculator.counters.num_draft_tokens > 0
    assert_clean(llm)


def test_chat_image_parts_match_transformers(qwen_vl_path, qwen_vl_oracle):
    """Chat image parts: the template writes Qwen's <|vision_start|><|image_pad|>
    <|vision_end|> per part, the processor expands each pad to the image's run."""
    model, processor = qwen_vl_oracle
    a, b = random_image(20, (140, 112)), random_image(21, (84, 196))
    llm = LLM(qwen_vl_path, dtype="float32")
    out = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image_pil", "image_pil": a},
        {"type": "text", "text": " and "}, {"type": "image_pil", "image_pil": b},
        {"type": "text", "text": " what differs?"}]}], GREEDY, use_tqdm=False)[0]
    template = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image"}, {"type": "text", "text": " what differs?"}]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE) == 2
    assert out.outputs[0].token_ids == hf_greedy_mm(model, processor, text, [a, b], MAX_NEW)
    assert_clean(llm)


def test_both_checkpoint_spellings_load(qwen_vl_path, reference, tmp_path):
    """transformers 5 writes `model.layers.*` / `visual.*` (the hub's spelling); its own
    module names are `model.language_model.*` / `model.visual.*`: the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    renamed = tmp_path / "renamed"
    shutil.copytree(qwen_vl_path, renamed)
    tensors = load_file(str(renamed / "model.safetensors"))
    new = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        elif name.startswith("visual."):
            name = "model." + name
        new[name] = t
    save_file(new, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(renamed), dtype="float32")
    assert run(llm, prompts()[:3]) == reference[:3]


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallelism_is_refused(qwen_vl_path, name):
    with pytest.raises(QuireValidationError, match="multimodal") as e:
        LLM(qwen_vl_path, dtype="float32", **{name: 2})
    assert e.value.field == name
