"""What the device can do: which device, which dtype `auto` means, which attention backend."""

from __future__ import annotations

import functools
import os

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device; "
                         "use device 'cpu' or 'auto'")
    return torch.device(name)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run ~3-4x faster than float32 (measured on a
    Xeon with AMX: ~500 vs ~150 GFLOPS at batch 64+)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def triton_available(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _importable("triton")
    return device.type == "cuda" and _importable("triton")


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


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
