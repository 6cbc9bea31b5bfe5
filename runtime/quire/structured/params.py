"""GuidedDecodingParams: what a request's output must match, validated when it is built.

Exactly one kind per request, named as in vLLM: `json` (a JSON schema, dict or string),
`json_object` (any JSON object), `regex`, `choice` (one of a list of strings) or `grammar`
(Lark, or GBNF as llama.cpp writes it). A schema or grammar the grammar library can't compile
raises ValueError here, naming what is wrong or unsupported, so bad input fails where the
request is built (HTTP 400) and never reaches the engine thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
            raise ValueError("guided decoding takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a boolean, "
                             f"got {self.disable_any_whitespace!r}")
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
                    raise ValueError(f"json must be a JSON schema; it is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"json must be a JSON schema object, got {type(value).__name__}")
            return ws + json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"json_object must be true, got {value!r}")
            return ws
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r}")
            return json.dumps(list(value))
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
        return value
