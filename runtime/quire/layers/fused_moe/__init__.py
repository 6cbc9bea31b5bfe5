"""Mixture-of-experts as one layer kind: routing (routing.py), pairs sorted by expert
(dispatch.py), one grouped matmul per projection over all experts (grouped.py on the CPU,
triton_moe.py on CUDA) with the top-k weights applied to the down projection's output, the
experts' weight formats (experts.py: float, int8, int4), and the per-expert reference loop
(reference.py). layer.py puts them together with tensor parallelism and loading."""

from quire.layers.fused_moe.layer import FusedMoE
from quire.layers.fused_moe.routing import softmax_topk, topk_softmax

__all__ = ["FusedMoE", "softmax_topk", "topk_softmax"]
