"""/tokenize and /detokenize, in the tokenizer pool like every other tokenizer call; and
/tokenizer_info (vLLM's, with --enable-tokenizer-info-endpoint: the tokenizer's configuration
and chat template, which lm-eval's remote tokenizer reads)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quire.entrypoints.chat_continuation import check_continuation
from quire.entrypoints.errors import bad_request
from quire.entrypoints.limits import check_prompt_chars
from quire.entrypoints.openai_protocol import DetokenizeRequest, TokenizeRequest
from quire.entrypoints.routers.common import read_body, serving_of

router = APIRouter()
info_router = APIRouter()  # registered only with --enable-tokenizer-info-endpoint, as in vLLM


@router.post("/tokenize")
async def tokenize(request: Request):
    serving = serving_of(request)
    req = await read_body(request, TokenizeRequest)
    info = serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if req.messages is not None:
        check_continuation(req.add_generation_prompt, req.continue_final_message, req.messages)
        tokens = await serving.chat_prompt_ids(req.messages, req.add_generation_prompt, info,
                                               check_length=False,
                                               template_kwargs=req.chat_template_kwargs,
                                               continue_final_message=req.continue_final_message)
    else:
        check_prompt_chars("prompt", len(req.prompt),
                           serving.limits.prompt_chars(info.max_model_len))
        tokens = await serving.pool.encode(req.prompt, req.add_special_tokens)
    out = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
    if req.return_token_strs:
        out["token_strs"] = await serving.pool.run(_token_strs, tokens)
    return out


def _token_strs(tokenizer, tokens: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokens)


@router.post("/detokenize")
async def detokenize(request: Request):
    serving = serving_of(request)
    req = await read_body(request, DetokenizeRequest)
    info = serving.check_model(req.model)
    limit = serving.limits.prompt_chars(info.max_model_len)
    if len(req.tokens) > limit:
        raise bad_request(f"tokens may hold at most {limit} ids (--max-prompt-chars), got "
                          f"{len(req.tokens)}", "tokens")
    if req.tokens and not 0 <= min(req.tokens) <= max(req.tokens) < info.vocab_size:
        bad = next(t for t in req.tokens if not 0 <= t < info.vocab_size)
        raise bad_request(f"tokens must be token ids in [0, {info.vocab_size}), got {bad}",
                          "tokens")
    return {"prompt": await serving.pool.decode(req.tokens)}


@info_router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    serving = serving_of(request)
    serving.check_model(None)  # 503 while the model (and its tokenizer) loads
    return tokenizer_config(serving.engine.tokenizer, serving.chat_template(None))


def tokenizer_config(tokenizer, chat_template: str | None) -> dict:
    """vLLM's TokenizerInfo: the tokenizer's init kwargs less its file paths, made JSON
    (special tokens as their text), its class name and the chat template."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _jsonable(value):
    if hasattr(value, "content"):  # AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # a path or an enum: its text
