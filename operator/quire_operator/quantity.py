"""Kubernetes resource quantities ("500m", "16Gi", "1e3"): the API server's grammar, and their values.

The CRD carries the same pattern (tests/charts/test_crd.py checks they agree), so `kubectl apply`
refuses "16GB" or "two"; the operator checks again because an older CRD may lack the pattern.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# apimachinery's quantity grammar without the sign: a request or limit is never negative.
NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
PATTERN = rf"^\+?{NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{NUMBER}))?$"
_QUANTITY = re.compile(PATTERN)

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}


def is_quantity(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and _QUANTITY.match(value) is not None


def value_of(quantity: int | str) -> Decimal:
    """The number a quantity stands for: "500m" → 0.5, "1Ki" → 1024. ValueError if it is none."""
    if not is_quantity(quantity):
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity")
    text = str(quantity).lstrip("+")
    for suffix, factor in _BINARY.items():
        if text.endswith(suffix):
            return Decimal(text[:-2]) * factor
    if text[-1] in _DECIMAL:
        return Decimal(text[:-1]) * _DECIMAL[text[-1]]
    try:
        return Decimal(text)  # plain or with an exponent
    except InvalidOperation as e:  # pragma: no cover - the pattern admits only numbers
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity") from e


def same_quantity(a: object, b: object) -> bool:
    """Whether two values are one quantity written two ways ("1" and 1, "1000m" and "1")."""
    try:
        return value_of(a) == value_of(b)  # type: ignore[arg-type]
    except ValueError:
        return False
