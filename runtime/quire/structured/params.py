"""GuidedDecodingParams: what a request's output must match, validated when it is built.

Exactly one kind per request, named as in vLLM: `json` (a JSON schema, dict or string),
`json_object` (any JSON object), `regex`, `choice` (one of a list of strings) or `grammar`
(Lark, or GBNF as llama.cpp writes it). A schema or grammar the grammar library can't compile
raises QuireValidationError here, naming the kind and what is wrong or unsupported, so bad
input fails where the request is built (HTTP 400) and never reaches the engine thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from quire.validation import QuireValidationError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, eq=False)
class GuidedDecodingParams:
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # vLLM's option: True forbids optional whitespace between JSON tokens. Our default is True
    # (vLLM's is False): small models given free whitespace often emit newlines until
    # max_tokens and never close the object.
    disable_any_whitespace: bool = True
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            # a clash is the second kind's fault; none at all, the whole spec's
            raise QuireValidationError(
                given[1] if given else "guided_decoding", "guided decoding takes exactly one "
                f"of json, json_object, regex, choice, grammar; got {given or 'none'}")
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise QuireValidationError("disable_any_whitespace",
                                       f"disable_any_whitespace must be a boolean, "
                                       f"got {self.disable_any_whitespace!r}",
                                       self.disable_any_whitespace)
        object.__setattr__(self, "key", (kind, self._canonical(kind)))
        from quire.structured.backend import check_grammar  # the library, only when used
        check_grammar(self)

    @property
    def kind(self) -> str:
        return self.key[0]

    # equal and hashed by what they compile to (a schema dict can't be hashed itself)
    def __eq__(self, other) -> bool:
        return isinstance(other, GuidedDecodingParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def _canonical(self, kind: str) -> str:
        """A string that names the grammar: the compiled-grammar cache key."""
        value = getattr(self, kind)
        ws = "" if self.disable_any_whitespace else "ws:"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise QuireValidationError(
                        "json", f"json must be a JSON schema; it is not valid JSON: {e}",
                        value) from None
            if not isinstance(value, (dict, bool)):
                raise QuireValidationError(
                    "json", f"json must be a JSON schema object, got {type(value).__name__}",
                    value)
            return ws + json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            if value is not True:
                raise QuireValidationError("json_object",
                                           f"json_object must be true, got {value!r}", value)
            return ws
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise QuireValidationError(
                    "choice", f"choice must be a non-empty list of non-empty strings, got "
                    f"{value!r}", value)
            return json.dumps(list(value))
        if not isinstance(value, str) or not value.strip():
            raise QuireValidationError(kind, f"{kind} must be a non-empty string, got "
                                             f"{value!r}", value)
        return value
