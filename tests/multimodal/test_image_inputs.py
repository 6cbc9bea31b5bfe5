"""The ways images come in (generate's prompt dict, chat's image parts) and what is refused,
each with a ValueError naming the field."""

from __future__ import annotations

import base64
import io

import pytest

from quire import LLM, SamplingParams
from quire.validation import QuireValidationError

from mm_helpers import hf_greedy_mm, random_image
from runtime_helpers import save_tiny_model, smollm2_tokenizer, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(llava_path):
    return LLM(llava_path, dtype="float32", max_num_batched_tokens=64)


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_matches_transformers(llm, hf_oracle):
    """A data URL (PNG) and a PIL image in one conversation: the processor's chat template
    places the image token per part; the output is transformers' on the same rendering."""
    model, processor = hf_oracle
    a, b = random_image(20), random_image(21, (70, 50))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "text", "text": " and "},
        {"type": "image_pil", "image_pil": b},
        {"type": "text", "text": " what differs?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    template = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image"}, {"type": "text", "text": " what differs?"}]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    assert text.count("<image>") == 2
    assert out.outputs[0].token_ids == hf_greedy_mm(model, processor, text, [a, b], 6)
    # the PNG decodes to the same pixels: one image, whichever way it came
    again = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image_pil", "image_pil": a},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": data_url(b)}},
        {"type": "text", "text": " what differs?"}]}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_tools_reach_a_prompt_with_images(llm, hf_oracle):
    """Tools go into an image chat's prompt as into a text one's (the template's own way, or
    Hermes-style in the system prompt): they were dropped, so tool_choice forced calls of
    tools the model was never shown."""
    from quire.entrypoints.tool_calls.render import template_inputs
    model, processor = hf_oracle
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    image = random_image(24)
    out = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "Weather where this is?"}, {"type": "image_pil", "image_pil": image}]}],
        GREEDY, use_tqdm=False, tools=tools)[0]
    template = [{"role": "user", "content": [{"type": "text", "text": "Weather where this is?"},
                                             {"type": "image"}]}]
    messages, extra = template_inputs(processor.chat_template, template, tools)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **extra)
    assert "get_weather" in text and text.count("<image>") == 1
    assert out.prompt_token_ids == list(processor(text=text, images=[image])["input_ids"][0])
    assert out.outputs[0].token_ids == hf_greedy_mm(model, processor, text, [image], 6)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_are_laid_over_white_as_transformers_does(llm, hf_oracle, mode):
    """transformers' processors composite transparency onto white (convert_to_rgb); dropping
    the alpha channel instead shows the colours under it, and the answer differs."""
    import numpy as np
    from PIL import Image
    model, processor = hf_oracle
    pixels = np.array(random_image(23, (48, 40)).convert("RGBA"))
    pixels[:, :24, 3] = 0  # the left half transparent (its colours hidden)
    image = Image.fromarray(pixels, "RGBA")
    if mode == "P":  # a palette with a transparent index
        image = image.convert("RGB").quantize(16)
        image.info["transparency"] = 0
    elif mode == "LA":
        image = image.convert("LA")
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY,
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(model, processor, text, [image], 6)


@pytest.mark.parametrize("data, field", [
    ({"image": "not an image"}, "multi_modal_data"),
    ({"image": [random_image(0), 3]}, "multi_modal_data"),
    ({"image": []}, "multi_modal_data"),
    ({"video": [random_image(0)]}, "multi_modal_data"),
    ("an image", "multi_modal_data"),
])
def test_bad_images_are_refused(llm, data, field):
    with pytest.raises(QuireValidationError) as e:
        llm.generate({"prompt": "USER: <image> ASSISTANT:", "multi_modal_data": data},
                     GREEDY, use_tqdm=False)
    assert e.value.field == field
    assert_idle(llm)


def test_placeholder_count_must_match_the_images(llm):
    with pytest.raises(QuireValidationError, match="placeholders for 2 images") as e:
        llm.generate({"prompt": "USER: <image> ASSISTANT:",
                      "multi_modal_data": {"image": [random_image(0), random_image(1)]}},
                     GREEDY, use_tqdm=False)
    assert e.value.field == "multi_modal_data"
    assert_idle(llm)


def test_bad_chat_parts_are_refused(llm):
    for part, field in [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
         "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
         "messages[0].content[0].image_url.url"),
        ({"type": "image_pil", "image_pil": b"png"}, "messages[0].content[0].image_pil"),
        ({"type": "audio", "audio": "x"}, "messages"),
    ]:
        with pytest.raises(QuireValidationError) as e:
            llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)
        assert e.value.field == field, part


def test_a_text_only_model_refuses_images(tmp_path):
    path = save_tiny_model(str(tmp_path / "llama"), tiny_config("llama"), smollm2_tokenizer())
    llm = LLM(path, dtype="float32")
    with pytest.raises(QuireValidationError, match="the model is not multimodal") as e:
        llm.generate({"prompt": "hi <image>", "multi_modal_data": {"image": random_image(0)}},
                     GREEDY, use_tqdm=False)
    assert e.value.field == "multi_modal_data"
    with pytest.raises(QuireValidationError, match="the model is not multimodal") as e:
        llm.chat([{"role": "user", "content": [{"type": "image_pil",
                                                "image_pil": random_image(0)}]}],
                 GREEDY, use_tqdm=False)
    assert e.value.field == "messages"
    assert llm.engine.snapshot().encoder_cache is None


def assert_idle(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.executor.multimodal.num_pending == 0
