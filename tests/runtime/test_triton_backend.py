"""The Triton kernels against the torch reference backend, in Triton's CPU interpreter.

`@triton.jit` picks the interpreter when a kernel is defined (Triton 3.x reads
TRITON_INTERPRET then, not when triton itself is imported), so the kernels are imported here
with TRITON_INTERPRET=1 set for that import only: the rest of the session still sees a CPU
where asking for Triton is an error, whatever order pytest collects modules in.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


with _env("TRITON_INTERPRET", "1"):
    from quire.attention import triton_backend
    from quire.attention.triton_kernels.cache_write import write_kv_cache

from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Output tolerances against the torch backend. fp32: both sides accumulate in fp32 in a
# different order. fp16/bf16: the reference rounds the probabilities to the activation dtype
# before P @ V while the kernels keep fp32 (bf16: upcast to fp32 for tl.dot, see common.py),
# and the interpreter truncates (not rounds) fp32 -> bf16 on the final store.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_kernels_run_in_the_interpreter():
    assert triton_backend.INTERPRETED, "the kernels were imported before TRITON_INTERPRET=1"


def reference_write(k, v, k_cache, v_cache, slots, k_scale, v_scale):
    """torch_backend.write_kv's rule (fp8 stores value / scale); index_copy_ has no fp8 CPU
    kernel, so fp8 goes through byte views."""
    hk, d = k_cache.shape[-2:]
    if k_cache.dtype != k.dtype:
        k = (k / k_scale).to(k_cache.dtype).view(torch.uint8)
        v = (v / v_scale).to(v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, hk, d).index_copy_(0, slots, k)
    v_cache.view(-1, hk, d).index_copy_(0, slots, v)


def split_qkv(t, h, hkv, d, dtype, gen, spread=1.0):
    """q, k, v as views of one fused projection, strided like the model's."""
    fused = (torch.randn(t, (h + 2 * hkv) * d, generator=gen) * spread).to(dtype)
    q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)


# ----------------------------------------------------------------------------- cache write

@pytest.mark.parametrize("dtype,kv,scale", [
    (torch.float32, None, 1.0), (torch.float16, None, 1.0), (torch.bfloat16, None, 1.0),
    (torch.float32, "e4m3", 0.37), (torch.float32, "e5m2", 3.1),
    (torch.float16, "e4m3", 0.5), (torch.bfloat16, "e5m2", 2.0),
])
def test_cache_write_stores_the_same_bytes_as_torch(dtype, kv, scale):
    gen = torch.Generator().manual_seed(0)
    t, hkv, d, bs, blocks = 37, 3, 64, 8, 12
    cache_dtype = FP8[kv] if kv else dtype
    _, k, v = split_qkv(t, 1, hkv, d, torch.float32, gen)
    if kv:  # from fp8 subnormals to the largest finite value, and round-up carries
        k = k * torch.exp2(torch.randint(-24, 12, k.shape, generator=gen).float())
        k = k.clamp(-FP8_MAX[cache_dtype] * scale, FP8_MAX[cache_dtype] * scale)
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    got = [torch.zeros(blocks, bs, hkv, d, dtype=cache_dtype) for _ in range(2)]
    want = [torch.zeros_like(got[0]) for _ in range(2)]
    write_kv_cache(k, v, *got, slots, scale, scale)
    reference_write(k, v, *want, slots, scale, scale)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
