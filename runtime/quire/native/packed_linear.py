"""bfloat16 linear layers on CPU with their weights packed once for oneDNN.

F.linear on a plain bf16 weight makes oneDNN reorder that weight into its blocked layout on
every call; packed once at load time, the same matmul is 1.3-2x faster at decode batch sizes
(and no slower for prefill), with bit-identical results (the same oneDNN kernel). These are
the ops torch's own CPU compiler emits for frozen bf16 linears. float32 stays on F.linear,
whose exact sums the transformers parity tests rely on; so does everything off the CPU.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of an [out, in] weight, or None when it can't be packed (then
    F.linear is used), after checking on a small input that it computes the same thing."""
    if not supported(weight):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        if torch.equal(linear(probe, packed, None), F.linear(probe, weight)):
            return packed
        logger.warning("packed bf16 linear differs from F.linear here; not using it")
    except RuntimeError as e:  # an op this torch build lacks for this shape or CPU
        logger.warning("cannot pack bf16 linear weights (%s); using F.linear", e)
    return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
