"""Chat messages with image parts, on the server: each part checked and named, its image
decoded (a data URL) or fetched (an http(s) URL, when the server allows it), the conversation
rendered by the processor's chat template and run through the processor, off the event loop.
What comes out is a ProcessedPrompt the engine takes as it is.

Public interface:
    image_parts(messages) -> [(where, url)]     the image parts, each with its place
                                                ("messages[0].content[1].image_url.url")
    await image_chat_prompt(serving, messages, add_generation_prompt, info, chat_template,
                            tools, template_kwargs, continue_final_message) -> ProcessedPrompt
        400s (OpenAIError) naming the part: a text-only model ("the model is not
        multimodal"), too many images, a URL that isn't a data URL when fetching is off, bad
        base64, a payload that isn't an image, one over the pixel limit, a failed fetch
"""

from __future__ import annotations

import copy
import threading

from quire.entrypoints import request_chat_template
from quire.entrypoints.chat_continuation import template_rejected
from quire.entrypoints.errors import bad_request, engine_error
from quire.entrypoints.limits import check_prompt_tokens
from quire.entrypoints.tool_calls.render import with_tools
from quire.multimodal.chat import image_chat_template, render_image_chat
from quire.multimodal.images import image_from_bytes, image_from_url
from quire.multimodal.inputs import ProcessedPrompt
from quire.multimodal.limits import check_image_count
from quire.validation import QuireValidationError

_local = threading.local()  # each tokenizer-pool thread's own copy of the processor


def image_parts(messages) -> list[tuple[str, str]]:
    found = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type == "image_url":
                url = part.image_url
                url = url.url if hasattr(url, "url") else url
                where = f"messages[{i}].content[{j}].image_url"
                if not isinstance(url, str) or not url:
                    raise bad_request(f"{where} must hold a url (a data:image/...;base64 URL"
                                      " or an http(s) URL)", where)
                found.append((f"{where}.url", url))
    return found


async def image_chat_prompt(serving, messages, add_generation_prompt: bool, info,
                            chat_template: str | None, tools: list[dict] | None,
                            template_kwargs: dict | None,
                            continue_final_message: bool = False) -> ProcessedPrompt:
    parts = image_parts(messages)
    if info.mm_processor is None:
        where = parts[0][0].removesuffix(".url")
        raise bad_request(f"the model is not multimodal: {info.served_name} "
                          f"({info.architecture}) takes text only, so {where} (an image part) "
                          "can't be served", where)
    try:
        check_image_count(len(parts), info.max_images_per_prompt, "messages")
        images = [await _load(serving, info.max_image_pixels, where, url)
                  for where, url in parts]
        conversation = [m.as_template_message(image_parts=True) for m in messages]
        extra = serving.template_kwargs(template_kwargs)
        own = None if chat_template is None else (  # a request's own: in the sandbox
            chat_template, serving.limits.chat_template_timeout,
            serving.limits.prompt_chars(info.max_model_len))
        processed = await serving.pool.run(_render_and_process, info.mm_processor,
                                           conversation, images, add_generation_prompt,
                                           own, extra, continue_final_message, tools)
    except (QuireValidationError, ValueError) as e:
        raise engine_error(e) from None
    check_prompt_tokens("messages", len(processed.token_ids), info.max_model_len)
    return processed


async def _load(serving, max_pixels: int, where: str, url: str):
    if url.startswith("data:"):
        return await serving.pool.run(_decode_data_url, url, where, max_pixels)
    data = await serving.limits.media_fetch().get(url, where)
    return await serving.pool.run(_decode_bytes, data, where, max_pixels)


def _decode_data_url(_tokenizer, url: str, where: str, max_pixels: int):
    return image_from_url(url, where, max_pixels)


def _decode_bytes(_tokenizer, data: bytes, where: str, max_pixels: int):
    return image_from_bytes(data, where, max_pixels)


def _special_tokens(mm_processor) -> dict[str, str]:
    tokenizer = mm_processor.processor.tokenizer
    return {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}


def _render_and_process(tokenizer, mm_processor, conversation, images,
                        add_generation_prompt, own_template, extra,
                        continue_final_message=False, tools=None) -> ProcessedPrompt:
    """In a pool thread, with that thread's own copies (a fast tokenizer is not to be shared
    between threads). `own_template`: (a request's own template, its time and size budget),
    rendered in the sandbox; None: the processor's."""
    copies = getattr(_local, "processors", None)
    if copies is None:
        copies = _local.processors = {}
    mine = copies.get(id(mm_processor))
    if mine is None:
        mine = copies[id(mm_processor)] = copy.deepcopy(mm_processor)
    if own_template is not None:
        template, timeout, max_chars = own_template
        conversation, extra = with_tools(template, conversation, tools, extra)
        text = request_chat_template.render(template, conversation, add_generation_prompt,
                                            _special_tokens(mine), timeout, max_chars, extra,
                                            continue_final_message)
        return mine.process(text, images, add_special_tokens=False)
    try:
        template = image_chat_template(mine, tokenizer)
        conversation, extra = with_tools(template, conversation, tools, extra)
        text = render_image_chat(mine, tokenizer, conversation, add_generation_prompt,
                                 template, continue_final_message=continue_final_message,
                                 **extra)
    except QuireValidationError:
        raise
    except Exception as e:  # noqa: BLE001 - templates raise on conversations they reject
        raise template_rejected(e) from None
    # the rendered text has the template's special tokens: the tokenizer adds none
    return mine.process(text, images, add_special_tokens=False)
