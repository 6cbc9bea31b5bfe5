"""A request's structured-output fields (response_format, guided_*, structured_outputs) ->
GuidedDecodingParams, within the server's bounds.

Building GuidedDecodingParams validates the schema or grammar with the grammar library, and
a big schema takes a while to encode and check: it runs in the tokenizer pool, never on the
event loop (the engine then compiles it on its own compile thread, cached by schema).
"""

from __future__ import annotations

from quire.entrypoints.errors import invalid_input
from quire.entrypoints.limits import check_schema_bytes
from quire.structured.params import GuidedDecodingParams
from quire.structured.request_formats import guided_decoding_from_request
from quire.validation import QuireValidationError


async def guided_decoding(serving, req) -> GuidedDecodingParams | None:
    """The request's grammar, or None; a 400 naming the field for anything wrong."""
    fields = req.structured_output_fields()
    if not fields or fields == {"response_format": {"type": "text"}}:
        return None  # nothing to check: no thread hop
    guided = await serving.pool.run(_build, fields, serving.limits.max_schema_bytes)
    if guided is not None:
        # compiled against the tokenizer before the request is accepted: what only that
        # finds (a spec no text matches) is a 400 naming the field, not an empty answer
        field = next(f for f in fields if f != "disable_any_whitespace")
        try:
            await serving.engine.compile_grammar(guided)
        except ValueError as e:
            raise invalid_input(QuireValidationError(field, f"{field}: {e}")) from None
    return guided


def _build(tokenizer, fields: dict, max_schema_bytes: int) -> GuidedDecodingParams | None:
    for name, value in fields.items():
        if name != "disable_any_whitespace":
            check_schema_bytes(name, value, max_schema_bytes)
    try:
        return guided_decoding_from_request(fields)
    except ValueError as e:  # request_formats' errors carry the request's field
        raise invalid_input(e) from None
