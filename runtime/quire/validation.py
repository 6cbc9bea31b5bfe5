"""The one place that says what a valid integer or number is, for every knob and field, and
the error bad input raises: a ValueError that carries the field it is about, so the server
answers with OpenAI's `param` without reading the message (DESIGN.md's conventions)."""

from __future__ import annotations

import math

_NO_VALUE = object()


class QuireValidationError(ValueError):
    """Bad input: `field` is the parameter as the caller wrote it (SamplingParams' `top_p`,
    an EngineArgs knob, a request's `tools`), `message` says what is allowed (str() is the
    message alone, so library users read the same text as before), `value` what was given
    when one value is at fault."""

    def __init__(self, field: str, message: str, value: object = _NO_VALUE) -> None:
        super().__init__(message)
        self.field, self.message = field, message
        self.value = None if value is _NO_VALUE else value


def field_of(error: BaseException) -> str | None:
    """The field a validation error names; None for any other error (its message is never
    read for one)."""
    return error.field if isinstance(error, QuireValidationError) else None


def is_strict_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, never to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int, hi: int | None = None,
              what: str | None = None, field: str | None = None) -> None:
    """`field`: the parameter, when the message's `name` is not it ("prompt token ids")."""
    if not (is_strict_int(value) and value >= lo and (hi is None or value <= hi)):
        raise QuireValidationError(
            field or name, f"{name} must be {what or f'an integer >= {lo}'}, got {value!r}",
            value)


def check_number(name: str, value: object, lo: float, hi: float | None, what: str) -> None:
    """A finite number in [lo, hi] (`hi` None: no upper bound; inf and NaN never pass, as the
    server's bodies refuse them: an infinite temperature divides the masks into NaN)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value >= lo and (hi is None or value <= hi)
    if not ok:
        raise QuireValidationError(name, f"{name} must be {what}, got {value!r}", value)
