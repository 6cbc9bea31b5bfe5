"""Which attention backend an engine runs (DESIGN.md: one interface; `auto` picks Triton on
CUDA and torch elsewhere)."""

from __future__ import annotations

import torch

from quire.platform import triton_available


def attention_backend_class(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if name == "torch":
        from quire.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend
    if not triton_available(device):
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device with triton installed (or "
            f"TRITON_INTERPRET=1 for tests); this engine runs on {device.type}. "
            "Use attention_backend 'torch' or 'auto'.")
    from quire.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend
