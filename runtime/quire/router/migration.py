"""Request migration: a stream whose replica dies, is drained or drops the connection goes on
on another replica, and the client sees one uninterrupted stream (Dynamo's migration).

    stream = MigratingStream(path, body)        # None from `for_request` when it can't migrate
    forwarded = stream.forwarded_body()         # the body with return_token_ids set
    for event in stream.feed(raw_bytes): ...    # what the client gets, or stream.broken
    stream.continuation_body()                  # for the next replica

The replica is asked for `return_token_ids`, so every chunk carries the ids of the tokens
whose text it brings. When the stream breaks (a cut connection, an error event, or a choice
finished with `abort`, which is what a draining replica's timeout gives), the router sends
the same request to another replica with `continue_token_ids` = the tokens streamed so far
(they follow the prompt there, so greedy decoding continues exactly where it stopped) and
max_tokens / min_tokens reduced by them. Its chunks are rewritten to the first replica's id
and `created`, its opening role chunk is dropped, and its usage block counts the continued
tokens as completion tokens again, so the client gets one stream and one usage block.

Migrated: streamed /v1/completions and /v1/chat/completions with one prompt and n == 1.
Sampled requests continue from the same position (a seeded one draws again from its seed
there: reproducible only where a run is, not the uninterrupted run's draws). Stop strings
that were still being matched on the first replica (their held-back text) are lost with it.
Non-streamed requests are resent whole (proxy.py's retry): nothing reached the client yet.
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

MIGRATABLE_PATHS = ("/v1/completions", "/v1/chat/completions")


def for_request(path: str, body) -> MigratingStream | None:
    if path not in MIGRATABLE_PATHS or not isinstance(body, dict) or body.get("stream") is not True:
        return None
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return None
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt \
            and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
        return None  # several prompts: several answers in one stream
    return MigratingStream(path, body)


class MigratingStream:
    def __init__(self, path: str, body: dict) -> None:
        self.path, self.body = path, body
        self.client_wants_ids = body.get("return_token_ids") is True
        self.token_ids: list[int] = []  # of the text the client has been sent
        self.continued = 0              # tokens the current replica was given to continue from
        self.head: dict | None = None   # id / created of the first replica's chunks
        self.broken: str | None = None  # why the current replica's stream is unusable
        self.done = False               # [DONE] was passed on
        self.finished = False           # the choice got its finish_reason
        self._buffer = b""
        self.chunks = None              # the current continuation's byte iterator (the proxy's)
        self.prompt_len: int | None = None  # the first replica's prompt_token_ids
        # a replica that sent text without its token ids, or ignored continue_token_ids (not a
        # Quire runtime): a continuation would repeat or skip text, so none is tried
        self.unsafe = False

    # --- bodies --------------------------------------------------------------------------
    def forwarded_body(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def continuation_body(self) -> bytes | None:
        """The request for the next replica, or None when nothing is left to generate or
        continuing would not be exact (`unsafe`)."""
        if self.unsafe:
            return None
        body = {**self.body, "return_token_ids": True, "continue_token_ids": list(self.token_ids),
                "echo": False}
        if self.path == "/v1/completions" and "max_tokens" not in body:
            body["max_tokens"] = 16  # the endpoint's default: what the first replica ran with
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int):
                body[name] -= len(self.token_ids)
                if body[name] <= 0:
                    return None
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - len(self.token_ids))
        if self.path == "/v1/chat/completions":
            body.pop("echo")
        return json.dumps(body).encode()

    def restart(self) -> None:
        """A new replica takes over from here."""
        self.continued = len(self.token_ids)
        self.broken = None
        self._buffer = b""

    # --- events --------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """The bytes to send the client for these bytes of the replica's stream (whole
        events only). Sets `broken` (and stops) at an event that calls for migration."""
        self._buffer += data
        out = []
        while b"\n\n" in self._buffer and self.broken is None:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            event = self._event(raw)
            if event is not None:
                out.append(event)
        return b"".join(out)

    def _event(self, raw: bytes) -> bytes | None:
        payload = b"\n".join(line[5:].lstrip() for line in raw.split(b"\n")
                             if line.startswith(b"data:"))
        if not payload:
            return raw + b"\n\n"
        if payload.strip() == b"[DONE]":
            self.done = True
            return raw + b"\n\n"
        try:
            obj = json.loads(payload)
        except ValueError:
            return raw + b"\n\n"
        if not isinstance(obj, dict):
            return raw + b"\n\n"
        if "error" in obj:
            self.broken = "error_event"
            return None
        choices = obj.get("choices") or []
        if any(c.get("finish_reason") == "abort" for c in choices):
            self.broken = "aborted"  # a draining replica's timeout, or it failed the request
            return None
        if self.head is None:
            self.head = {"id": obj.get("id"), "created": obj.get("created")}
        elif self.continued:
            obj.update({k: v for k, v in self.head.items() if v is not None})
        for c in choices:
            if not self._check_ids(c):
                return None
            ids = c.get("token_ids") or []
            self.token_ids.extend(ids)
            if c.get("finish_reason") is not None:
                self.finished = True
            if self.continued:
                c.pop("prompt_token_ids", None)  # the prompt plus the continued tokens
            if not self.client_wants_ids:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
        if self.continued and _opening_only(choices):
            return None  # the continuation's role chunk: the client had the first one
        usage = obj.get("usage")
        if self.continued and isinstance(usage, dict):
            usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.continued
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.continued
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                # the replica's cache hit covers a prefix of prompt + continued tokens; of the
                # client's prompt, at most all of it was cached
                details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() \
            + b"\n\n"


    def _check_ids(self, c: dict) -> bool:
        """Whether this replica keeps the token-id contract; False (and broken) if not."""
        prompt = c.get("prompt_token_ids")
        if isinstance(prompt, list):
            if self.prompt_len is None:
                self.prompt_len = len(prompt)
            elif self.continued and len(prompt) != self.prompt_len + self.continued:
                self.unsafe, self.broken = True, "not_continued"  # it ignored continue_token_ids
                return False
        carries = c.get("text") or (c.get("delta") or {}).get("content")
        if carries and "token_ids" not in c:
            self.unsafe = True  # migrating would not know where the text stopped
        return True


def _opening_only(choices: list) -> bool:
    return bool(choices) and all(
        not c.get("token_ids") and c.get("finish_reason") is None
        and isinstance(c.get("delta"), dict) and not c["delta"].get("content")
        and set(c["delta"]) <= {"role", "content"} for c in choices)
