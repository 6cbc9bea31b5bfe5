"""Images through the HTTP APIs of a live `quire serve` (a tiny random LLaVA), with the
official clients: OpenAI chat with image_url parts (data URLs; http URLs where the server
fetches), the Responses API's input_image and Anthropic's image blocks, each answer equal
to transformers' greedy one on the processor's own inputs. Every refusal is a 400 naming
the part and the reason; the server stays up and the next request is still exact."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
import requests
from PIL import Image

from mm_helpers import hf_greedy_mm, random_image
from server_harness import ServerProcess, metric, openai_client, tiny_model, wait_idle

MAX_NEW = 8
BASE = ["--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1"]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


IMAGES = [random_image(30), random_image(31, (70, 50)), random_image(32, (33, 47))]


class _Origin(http.server.BaseHTTPRequestHandler):
    """Serves IMAGES[i] at /i.png."""

    def do_GET(self):  # noqa: N802 - http.server's name
        try:
            body = png(IMAGES[int(self.path.strip("/").removesuffix(".png"))])
        except (ValueError, IndexError):
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def servers(llava_path):
    """Three servers loading side by side: LLaVA as shipped (fetching off, two images a
    prompt), LLaVA fetching from 127.0.0.1 only, and a text-only model."""
    made = {
        "llava": ServerProcess("llava", [llava_path, *BASE, "--limit-mm-per-prompt",
                                         '{"image": 2}']),
        "fetch": ServerProcess("llava-fetch", [llava_path, *BASE, "--allowed-media-domains",
                                               "127.0.0.1"]),
        "text": ServerProcess("text-only", [tiny_model(), *BASE]),
    }
    for s in made.values():
        s.start()
    try:
        for s in made.values():
            s.wait_ready(300)
        yield made
    finally:
        for s in made.values():
            s.stop()


def expected_text(hf_oracle, parts: list, images: list) -> tuple[str, int]:
    """transformers' greedy answer (as text) and prompt length for one user message."""
    model, processor = hf_oracle
    template = [{"role": "user", "content": parts}]
    prompt = processor.apply_chat_template(template, add_generation_prompt=True,
                                           tokenize=False)
    ids = hf_greedy_mm(model, processor, prompt, images, MAX_NEW)
    length = len(processor(text=prompt, images=images, return_tensors="pt",
                           add_special_tokens=False)["input_ids"][0])
    return processor.tokenizer.decode(ids, skip_special_tokens=True), length


def chat(srv, content, **kw):
    return openai_client(srv).chat.completions.create(
        model=srv.args[0], messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW, temperature=0, **kw)


def test_openai_chat_with_images_matches_transformers(servers, hf_oracle):
    """One and two images in a message; streamed and not: transformers' answer each time."""
    srv = servers["llava"]
    one = [{"type": "text", "text": "What is this? "},
           {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}]
    two = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[1]), "detail": "low"}},
           {"type": "text", "text": " versus "},
           {"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}}]
    for content, images, template in (
            (one, IMAGES[:1], [{"type": "text", "text": "What is this? "}, {"type": "image"}]),
            (two, IMAGES[1:], [{"type": "image"}, {"type": "text", "text": " versus "},
                               {"type": "image"}])):
        want, prompt_len = expected_text(hf_oracle, template, images)
        out = chat(srv, content)
        assert out.choices[0].message.content == want
        assert out.usage.prompt_tokens == prompt_len
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(srv, content,
                                                                           stream=True)
                           if c.choices)
        assert streamed == want
    samples = wait_idle(srv)
    assert metric(samples, "quire:kv_cache_blocks_used") == 0
    # the repeated requests found their images' embeddings cached
    assert metric(samples, "quire:mm_encoder_cache_hits_total") >= 1
    assert metric(samples, "quire:mm_encoder_images_total") == 3
    assert metric(samples, "quire:mm_encoder_seconds_total") > 0


def test_responses_and_anthropic_images_match_transformers(servers, hf_oracle):
    import anthropic
    srv = servers["llava"]
    want, _ = expected_text(hf_oracle, [{"type": "text", "text": "Describe"},
                                        {"type": "image"}], IMAGES[:1])
    client = openai_client(srv)
    response = client.responses.create(model=srv.args[0], max_output_tokens=MAX_NEW,
                                       temperature=0, input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Describe"},
                                           {"type": "input_image",
                                            "image_url": data_url(IMAGES[0])}]}])
    assert response.output_text == want
    aclient = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Describe"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data_url(IMAGES[0]).split(",", 1)[1]}}]}]
    message = aclient.messages.create(model=srv.args[0], max_tokens=MAX_NEW,
                                      extra_body={"temperature": 0}, messages=messages)
    assert message.content[0].text == want
    # count_tokens renders the images as the message does: its placeholders counted
    counted = aclient.messages.count_tokens(model=srv.args[0], messages=messages)
    assert counted.input_tokens == (message.usage.input_tokens
                                    + message.usage.cache_read_input_tokens)


def test_fetched_image_is_the_same_image(servers, origin, hf_oracle):
    """An http URL on the allowed host answers as the same image sent inline; one on
    another host is refused, naming it."""
    srv = servers["fetch"]
    want, _ = expected_text(hf_oracle, [{"type": "image"}], IMAGES[2:])
    out = chat(srv, [{"type": "image_url", "image_url": {"url": f"{origin}/2.png"}}])
    assert out.choices[0].message.content == want
    inline = chat(srv, [{"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}}])
    assert inline.choices[0].message.content == want
    other = origin.replace("127.0.0.1", "localhost")
    error = bad_request(srv, [{"type": "image_url", "image_url": {"url": f"{other}/2.png"}}])
    assert "host 'localhost' is not among the allowed media domains" in error["message"]
    missing = bad_request(srv, [{"type": "image_url", "image_url": {"url": f"{origin}/9.png"}}])
    assert "answered HTTP 404" in missing["message"]


def bad_request(srv, content) -> dict:
    r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": srv.args[0], "max_tokens": 2,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


HUGE = "data:image/png;base64," + base64.b64encode(png(Image.new("L", (8000, 8000)))).decode()
REFUSALS = [
    ([image_part("data:image/png;base64,@@@not-base64")], "messages[0].content[0].image_url.url",
     "not valid base64"),
    ([{"type": "text", "text": "hi"},
      image_part("data:image/png;base64," + base64.b64encode(b"GIF? no, text").decode())],
     "messages[0].content[1].image_url.url", "is not an image"),
    ([image_part(HUGE)], "messages[0].content[0].image_url.url",
     "8000x8000 = 64000000 pixels; at most 16777216"),
    ([image_part(data_url(IMAGES[0]))] * 3, "messages",
     "3 images; at most 2 are accepted per prompt (--limit-mm-per-prompt"),
    ([image_part("http://127.0.0.1:1/cat.png")], "messages[0].content[0].image_url.url",
     "fetching http(s) image URLs is off on this server"),
    ([{"type": "image_url", "image_url": {}}], "messages", "url"),
]


@pytest.mark.parametrize("content,param,words", REFUSALS,
                         ids=["base64", "not-image", "pixels", "too-many", "fetch-off",
                              "no-url"])
def test_bad_images_are_400s_naming_the_part(servers, hf_oracle, content, param, words):
    srv = servers["llava"]
    error = bad_request(srv, content)
    assert words in error["message"]
    assert error["param"] == param
    # the server is up and still exact
    want, _ = expected_text(hf_oracle, [{"type": "image"}], IMAGES[:1])
    assert chat(srv, [image_part(data_url(IMAGES[0]))]).choices[0].message.content == want
    assert metric(wait_idle(srv), "quire:kv_cache_blocks_used") == 0


def test_text_only_model_says_it_is_not_multimodal(servers):
    srv = servers["text"]
    error = bad_request(srv, [{"type": "text", "text": "Look:"},
                              image_part(data_url(IMAGES[0]))])
    assert error["message"].startswith("the model is not multimodal:")
    assert "messages[0].content[1].image_url" in error["message"]
    assert error["param"] == "messages[0].content[1].image_url"
    # count_tokens refuses the image the same way (in Anthropic's shape)
    r = requests.post(srv.url + "/v1/messages/count_tokens", json={
        "model": srv.args[0], "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(IMAGES[0]).split(",", 1)[1]}}]}]},
        timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("the model is not multimodal:")
    # text still works, and the encoder's metrics are a multimodal model's only
    assert chat(srv, "Hello").choices[0].finish_reason in ("stop", "length")
    samples = wait_idle(srv)
    assert not any(name.startswith("quire:mm_encoder") for name, _ in samples)


def test_tools_reach_an_image_chats_prompt_on_the_server(servers, hf_oracle):
    """As in a text chat, the tools are in the prompt (Hermes-style for LLaVA's template):
    transformers' answer to that rendering."""
    from quire.entrypoints.tool_calls.render import template_inputs
    model, processor = hf_oracle
    srv = servers["llava"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages, extra = template_inputs(processor.chat_template, [{"role": "user", "content": [
        {"type": "text", "text": "What is this? "}, {"type": "image"}]}], tools)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False, **extra)
    assert "get_weather" in prompt
    out = chat(srv, [{"type": "text", "text": "What is this? "},
                     {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}],
               tools=tools)
    ids = hf_greedy_mm(model, processor, prompt, IMAGES[:1], MAX_NEW)
    assert out.usage.prompt_tokens == len(processor(text=prompt, images=IMAGES[:1],
                                                    add_special_tokens=False)["input_ids"][0])
    assert out.choices[0].message.content == processor.tokenizer.decode(
        ids, skip_special_tokens=True)
