"""PoolingParams: how one embedding request is pooled (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from quire.sampling_params import RequestOutputKind
from quire.validation import QuireValidationError, check_int


@dataclass
class PoolingParams:
    dimensions: int | None = None   # matryoshka: keep the first this many, renormalized
    normalize: bool | None = None   # None: as the model's sentence-transformers files say
    output_kind = RequestOutputKind.FINAL_ONLY  # (not a field) one output, when it is done

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, lo=1, what="a positive integer or None")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise QuireValidationError("normalize", f"normalize must be a boolean or None, got "
                                       f"{self.normalize!r}", self.normalize)
