"""The one error a bad spec raises (its own module: spec.py and router_spec.py both raise it)."""


class SpecError(ValueError):
    """An invalid spec; `field` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
