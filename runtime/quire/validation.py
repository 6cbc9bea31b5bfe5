"""The one place that says what a valid integer or number is, for every knob and field:
errors name the field and the allowed range (DESIGN.md's conventions)."""

from __future__ import annotations


def is_strict_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, never to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int, hi: int | None = None,
              what: str | None = None) -> None:
    if not (is_strict_int(value) and value >= lo and (hi is None or value <= hi)):
        raise ValueError(f"{name} must be {what or f'an integer >= {lo}'}, got {value!r}")


def check_number(name: str, value: object, lo: float, hi: float | None, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and value == value and value >= lo and (hi is None or value <= hi)  # NaN fails
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")
