"""RMS norms in the operation order of the transformers families that use them (float32
parity rests on it)."""

from __future__ import annotations

import torch
from torch import nn

from quire import parallel_state as ps
from quire.native.fused_ops import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """Llama's: normalize in float32, cast back, then times the weight (also Qwen3's, OLMo 2's
    and Granite's; OLMo 2 multiplies before the cast, the same in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' LlamaRMSNorm of x; with a residual, of residual += x (in place)."""
        return rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's: float32 throughout, times (1 + weight), then cast (its weights are stored as
    offsets from one)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm over each head of x [T, H, D] (Qwen3's and Gemma 3's q/k norms)."""
    t, h, d = x.shape
    if isinstance(norm, RMSNorm):
        return rms_norm(x.reshape(t * h, d), norm.weight, norm.eps).view(t, h, d)
    return norm(x)


class ShardedRMSNorm(RMSNorm):
    """An RMS norm over a whole projection whose heads are split across tensor-parallel
    ranks (OLMo 2's q/k norms): each rank holds the weight of its own heads, and the mean of
    squares is taken over every distinct head of the full projection. `head_owner`: for each
    of the full projection's heads, whether this rank holds it (KV heads replicated on
    several ranks count once)."""

    def __init__(self, full_size: int, local_heads: list[int], head_dim: int,
                 eps: float) -> None:
        super().__init__(len(local_heads) * head_dim, eps)
        self.full_size, self.head_dim = full_size, head_dim
        self.local_heads = local_heads  # this rank's heads, by their index in the projection
        self.tp_size = ps.tp_size()  # read while the model is built, as the linears do

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        """The checkpoint's weight covers the full projection: keep this rank's heads."""
        from quire.layers.weights import materialize, narrow
        d = self.head_dim
        part = narrow(loaded, 0, self.local_heads[0] * d, len(self.local_heads) * d)
        param.data.copy_(materialize(part))

    def forward(self, x: torch.Tensor, residual=None) -> torch.Tensor:
        if self.tp_size == 1:
            return rms_norm_ref(x, self.weight, self.eps)
        t = x.shape[0]
        dtype = x.dtype
        h = x.float()
        # each head's sum of squares, gathered from every rank, each distinct head once
        per_head = h.view(t, len(self.local_heads), self.head_dim).pow(2).sum(-1)
        full = h.new_zeros(t, self.full_size // self.head_dim)
        mine = torch.zeros_like(full)
        mine[:, self.local_heads] = per_head
        owners = torch.zeros(full.shape[1], dtype=h.dtype, device=h.device)
        owners[self.local_heads] = 1.0
        ps.all_reduce(mine)
        ps.all_reduce(owners)
        variance = (mine / owners).sum(-1, keepdim=True) / self.full_size
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)
