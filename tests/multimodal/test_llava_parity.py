"""LLaVA through Quire against transformers (float32 greedy, the processor's own inputs):
one and two images per prompt, chunks that cut through an image's placeholder run, and
preemption by recompute with a small KV cache."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams

from mm_helpers import hf_greedy_mm, random_image

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
# (text, image seeds): images of several sizes (the processor resizes and crops each)
CASES = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [0]),
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [1]),
    ("USER: Compare <image> with <image> please. ASSISTANT:", [2, 3]),
    ("<image><image>", [4, 5]),   # two placeholder runs side by side
    ("A long preamble before the image, so that the image starts past the first KV block "
     "of sixteen tokens: <image> and then text after it. ASSISTANT:", [6]),
]
SIZES = {0: (40, 32), 1: (64, 64), 2: (90, 50), 3: (30, 70), 4: (56, 56), 5: (120, 80),
         6: (33, 47)}


def prompts():
    return [{"prompt": text, "multi_modal_data": {"image": [random_image(s, SIZES[s])
                                                            for s in seeds]}}
            for text, seeds in CASES]


def expected(hf_oracle):
    model, processor = hf_oracle
    return [hf_greedy_mm(model, processor, p["prompt"], p["multi_modal_data"]["image"],
                         MAX_NEW) for p in prompts()]


@pytest.fixture(scope="module")
def reference(hf_oracle):
    out = expected(hf_oracle)
    assert out[0] != out[1]  # the same text with another image: the image matters
    return out


def run(llm: LLM, batch) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    """Every KV block returned and every image's pixels let go once all requests ended."""
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert llm.engine.executor.multimodal.num_pending == 0


@pytest.mark.parametrize("budget", [2048, 12])
def test_greedy_matches_transformers(llava_path, reference, budget):
    """12 tokens a step: the prefill chunks cut through the 16-token placeholder runs, so a
    chunk takes a slice of an image's embeddings (the encoder runs once, at the first)."""
    llm = LLM(llava_path, dtype="float32", max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    assert run(llm, prompts()) == reference
    counts = llm.engine.snapshot().encoder_cache
    assert counts["misses"] == len(SIZES)  # each image encoded once, however cut
    assert_clean(llm)


def test_one_prompt_at_a_time(llava_path, reference):
    llm = LLM(llava_path, dtype="float32", max_num_batched_tokens=20)
    assert [run(llm, [p])[0] for p in prompts()] == reference
    assert_clean(llm)


def test_preemption_recomputes_the_images(llava_path, reference):
    """A KV cache of 10 blocks for prompts of 2 to 5 blocks each: sequences are preempted
    (recompute) and their prompts, images and all, computed again."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads of 16, fp32
    llm = LLM(llava_path, dtype="float32", max_num_batched_tokens=24,
              kv_cache_memory=10 * block_bytes, enable_prefix_caching=False)
    assert run(llm, prompts() * 2) == reference * 2
    assert llm.engine.snapshot().preemptions.get("recompute", 0) > 0
    assert_clean(llm)


def test_samples_of_one_prompt_share_its_image(llava_path, reference):
    """n = 2: the second sample is forked from the first's prompt blocks, images and all."""
    llm = LLM(llava_path, dtype="float32", max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, n=2)
    out = llm.generate(prompts()[2], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 2
    assert llm.engine.snapshot().encoder_cache["misses"] == 2  # its two images, once each
    assert_clean(llm)


def test_both_checkpoint_spellings_load(llava_path, reference, tmp_path):
    """transformers writes `language_model.model.*` / `vision_tower.*`; checkpoints made
    after its 4.52 rename say `model.language_model.*` / `model.vision_tower.*` /
    `lm_head.*`: the same weights either way."""
    import shutil

    from safetensors.torch import load_file, save_file
    renamed = tmp_path / "renamed"
    shutil.copytree(llava_path, renamed)
    tensors = load_file(str(renamed / "model.safetensors"))
    new = {}
    for name, t in tensors.items():
        for old, now in (("language_model.model.", "model.language_model."),
                         ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower.vision_model."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = now + name[len(old):]
                break
        new[name] = t
    assert any(k.startswith("model.language_model.") for k in new)
    save_file(new, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(renamed), dtype="float32")
    assert run(llm, prompts()[:3]) == reference[:3]


def test_tower_stops_at_the_feature_layer(llava_path):
    """vision_feature_layer -2 of a 3-layer CLIP tower: the last layer is neither built nor
    run (its output is never read), and the features are still transformers' (above)."""
    llm = LLM(llava_path, dtype="float32")
    tower = llm.engine.executor.runner.model.vision_tower
    assert len(tower.encoder.layers) == 2
    assert llm.engine.executor.runner.model.feature_layers == [2]
