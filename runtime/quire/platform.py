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


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo, "" where there is no such file or field."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is no such file."""
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor_id (/proc/cpuinfo: GenuineIntel, AuthenticAMD), "" where unknown."""
    return _cpuinfo("vendor_id")


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run ~3-4x faster than float32 (measured on a
    Xeon with AMX: ~500 vs ~150 GFLOPS at batch 64+)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


# The step's token budget when none is given. On CUDA a 2,048-token step takes tens of
# milliseconds. On a CPU it takes seconds on few cores (5.5 s on a 2-core EPYC VM, SmolLM2),
# and every running stream waits that long for its next token while a prompt prefills, so the
# budget follows the compute threads: 256 tokens each, within [512, 2048]. On that 2-core
# machine, 512-token steps ran the offline benchmark about as fast as 2,048 (91-103 against
# 97-99 tok/s across runs), cut prefix_cache.py's mean TTFT with caching on from 9.5-13.2 s
# to 8.5-10.4 s, and cost an 8,000-token prompt 5-20% of its prefill (more, shorter steps).
# benchmarks/HISTORY.md has the figures.
CUDA_STEP_BUDGET = 2048
CPU_STEP_BUDGET_PER_THREAD = 256
CPU_STEP_BUDGET_RANGE = (512, 2048)


def default_step_budget(device: torch.device, num_threads: int) -> int:
    """max_num_batched_tokens when the user gave none (see above)."""
    if device.type == "cuda":
        return CUDA_STEP_BUDGET
    lo, hi = CPU_STEP_BUDGET_RANGE
    return min(hi, max(lo, CPU_STEP_BUDGET_PER_THREAD * num_threads))


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
