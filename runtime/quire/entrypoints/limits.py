"""Every limit the server puts on a client, in one place: the numbers (each one a flag of
`quire serve`, documented in docs/serving.md) and the checks that enforce them on a request.

Work is refused by size before it is done: the body's bytes (before it is read), then the
prompt's characters (before it is tokenized), then its tokens (before the engine sees it).
Every refusal is a 4xx in OpenAI's shape naming the field and the allowed range.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from quire.entrypoints.engine_args import byte_size
from quire.entrypoints.errors import OpenAIError, bad_request

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
CHARS_PER_TOKEN_BOUND = 16  # default --max-prompt-chars is this many per context token


@dataclass
class ServerLimits:
    # --- HTTP (bytes and seconds) --------------------------------------------------------
    max_request_body_bytes: int = 8 << 20
    request_body_timeout: float = 60.0
    timeout_header: float = 10.0
    timeout_keep_alive: float = 5.0
    max_header_bytes: int = 16 << 10
    limit_concurrency: int | None = None
    # --- request fields ------------------------------------------------------------------
    max_prompt_chars: int | None = None   # None: CHARS_PER_TOKEN_BOUND x max_model_len
    max_prompts_per_request: int = 64
    max_messages: int = 512
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    # --- structured output and tools -----------------------------------------------------
    max_schema_bytes: int = 64 << 10      # one structured-output spec; all tools together
    max_tools: int = 128
    # --- CPU work off the event loop -----------------------------------------------------
    tokenizer_pool_size: int = 2
    tokenizer_pool_queue: int = 64
    # --- a request's own chat template ---------------------------------------------------
    allow_request_chat_template: bool = False
    chat_template_timeout: float = 1.0
    max_chat_template_chars: int = 64 << 10
    # --- /v1/responses' stored responses (previous_response_id, GET) ---------------------
    max_stored_responses: int = 1024
    stored_response_ttl: float = 3600.0
    # --- images a chat message links to (a vision-language model's) ----------------------
    allow_media_fetch: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    media_fetch_timeout: float = 5.0
    max_media_bytes: int = 20 << 20

    def media_fetch(self):
        from quire.multimodal.fetch import MediaFetch
        domains = None if self.allowed_media_domains is None else tuple(
            d.lower() for d in self.allowed_media_domains)
        return MediaFetch(self.allow_media_fetch, domains, self.media_fetch_timeout,
                          self.max_media_bytes)

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN_BOUND * max_model_len


HELP = {
    "max_request_body_bytes": "bigger request bodies get 413 before they are read "
                              "(K/M/G suffixes)",
    "request_body_timeout": "seconds a client may take to send a request body (else 408)",
    "timeout_header": "seconds a connection may take to send a request's headers before it "
                      "is closed (slowloris)",
    "timeout_keep_alive": "seconds an idle keep-alive connection stays open",
    "max_header_bytes": "request line plus header fields, in bytes (h11's limit); more "
                        "gets 400",
    "limit_concurrency": "connections plus tasks beyond which uvicorn answers 503 "
                         "(default: unlimited; probes count too)",
    "max_prompt_chars": f"characters of one prompt (or all messages) before tokenizing; "
                        f"default {CHARS_PER_TOKEN_BOUND} x max_model_len",
    "max_prompts_per_request": "prompts in one /v1/completions request",
    "max_messages": "messages in one chat request",
    "max_stop_strings": "strings in 'stop'",
    "max_stop_string_chars": "characters of one stop string",
    "max_stop_token_ids": "ids in 'stop_token_ids'",
    "max_schema_bytes": "bytes (as JSON) of a request's structured-output spec "
                        "(response_format's schema, guided_json / regex / choice / grammar, "
                        "structured_outputs), and of its tools together (K/M suffixes)",
    "max_tools": "functions in one chat request's 'tools'",
    "tokenizer_pool_size": "threads that tokenize, detokenize and render chat templates",
    "tokenizer_pool_queue": "tokenizer jobs waiting beyond which requests get 503",
    "allow_request_chat_template": "accept a request's own 'chat_template' (rendered in a "
                                   "jinja2 sandbox within a time and size budget)",
    "chat_template_timeout": "seconds a request's own chat template may take to render",
    "max_chat_template_chars": "characters of a request's own chat template",
    "max_stored_responses": "responses /v1/responses keeps in memory for "
                            "previous_response_id and GET (the oldest are dropped first)",
    "stored_response_ttl": "seconds a stored response is kept (after that its id is 404)",
    "allow_media_fetch": "fetch http(s) image URLs in chat messages (off: data URLs only)",
    "allowed_media_domains": "hosts image URLs may be fetched from (vLLM's flag; implies "
                             "fetching, of these hosts only, each redirect's too)",
    "media_fetch_timeout": "seconds one image fetch may take, redirects included",
    "max_media_bytes": "bytes of one fetched image (K/M suffixes)",
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits")
    for f in fields(ServerLimits):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "allowed_media_domains":
            group.add_argument(flag, nargs="+", default=None, metavar="HOST",
                               help=HELP[f.name])
        elif f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=HELP[f.name])
        else:
            kind = float if "float" in str(f.type) else int
            parse = _positive(byte_size if f.name.endswith("_bytes") else kind)
            group.add_argument(flag, type=parse, default=f.default,
                               help=HELP[f.name] + f" (default: {f.default})")


def limits_from(ns: argparse.Namespace) -> ServerLimits:
    values = {f.name: getattr(ns, f.name) for f in fields(ServerLimits) if hasattr(ns, f.name)}
    if values.get("allowed_media_domains") is not None:
        values["allowed_media_domains"] = tuple(values["allowed_media_domains"])
    return ServerLimits(**values)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


# --- checks on parsed requests ------------------------------------------------------------
def check_count(name: str, items, limit: int, flag: str) -> None:
    if items is not None and not isinstance(items, str) and len(items) > limit:
        raise bad_request(f"{name} may hold at most {limit} items (--{flag}), "
                          f"got {len(items)}", name)


def check_stop(stop, stop_token_ids, limits: ServerLimits, vocab_size: int) -> None:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    check_count("stop", stops, limits.max_stop_strings, "max-stop-strings")
    for s in stops:
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"stop strings may be at most {limits.max_stop_string_chars} "
                              f"characters (--max-stop-string-chars), got {len(s)}", "stop")
    check_count("stop_token_ids", stop_token_ids, limits.max_stop_token_ids,
                "max-stop-token-ids")
    for t in stop_token_ids or ():  # (the model's vocabulary: only the server knows it)
        if isinstance(t, int) and not 0 <= t < vocab_size:
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}) (this "
                              f"model's vocabulary), got {t}", "stop_token_ids")


def check_schema_bytes(name: str, value, limit: int) -> None:
    """A schema, grammar or tool list no bigger than --max-schema-bytes (measured as JSON;
    called in the tokenizer pool: a big one takes a while to encode)."""
    size = len(value.encode()) if isinstance(value, str) else len(
        json.dumps(value, separators=(",", ":")).encode())
    if size > limit:
        raise bad_request(f"{name} is {size} bytes as JSON; at most {limit} are accepted "
                          f"(--max-schema-bytes)", name)


def check_prompt_chars(param: str, num_chars: int, limit: int) -> None:
    if num_chars > limit:
        raise bad_request(f"{param} is {num_chars} characters; at most {limit} are accepted "
                          f"(--max-prompt-chars)", param)


def check_prompt_tokens(param: str, num_tokens: int, max_model_len: int,
                        pooling: bool = False) -> None:
    """A generated answer needs a slot after the prompt; a pooled input (embeddings) does
    not, so it may fill the context."""
    if num_tokens > max_model_len or (num_tokens == max_model_len and not pooling):
        most = f"at most {max_model_len}" if pooling else f"shorter than {max_model_len}"
        raise bad_request(f"{param} is {num_tokens} tokens; this model's context is "
                          f"{max_model_len} tokens, so {'inputs' if pooling else 'prompts'} "
                          f"must be {most} tokens", param)


def check_messages(messages, limits: ServerLimits, max_model_len: int) -> None:
    if not messages:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    check_count("messages", messages, limits.max_messages, "max-messages")
    total = 0
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                              f"got {m.role[:40]!r}", "messages")
        total += m.num_chars()
    check_prompt_chars("messages", total, limits.prompt_chars(max_model_len))


def check_chat_template(template: str | None, limits: ServerLimits) -> None:
    if template is None:
        return
    if not limits.allow_request_chat_template:
        raise bad_request("chat_template in a request is disabled on this server (start it "
                          "with --allow-request-chat-template to accept it)", "chat_template")
    if len(template) > limits.max_chat_template_chars:
        raise bad_request(f"chat_template may be at most {limits.max_chat_template_chars} "
                          f"characters (--max-chat-template-chars), got {len(template)}",
                          "chat_template")


# what the server itself hands the template (or apply_chat_template's own options): a
# request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def check_chat_template_kwargs(kwargs: dict | None, limits: ServerLimits,
                               max_model_len: int) -> None:
    """No reserved names; the values may end up in the prompt, so their JSON counts against
    the prompt's characters."""
    if not kwargs:
        return
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets "
                          f"it", "chat_template_kwargs")
    check_prompt_chars("chat_template_kwargs", len(json.dumps(kwargs)),
                       limits.prompt_chars(max_model_len))


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than {limit} bytes "
                            f"(--max-request-body-bytes)", "invalid_request_error", None,
                       "request_too_large")


def body_too_slow(seconds: float) -> OpenAIError:
    return OpenAIError(408, f"the request body took longer than {seconds:g}s to arrive "
                            f"(--request-body-timeout)", "invalid_request_error", None,
                       "request_timeout")
