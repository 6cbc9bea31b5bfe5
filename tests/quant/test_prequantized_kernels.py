"""The pieces behind pre-quantized checkpoints: act-order column plans (a rank's shard of
g_idx gives runs of any length), the int8 fallback where fp32 scales make int4's zero
inexact, the FP8 CPU kernel's tiles, and the Triton FP8 dequantize in the interpreter."""

from __future__ import annotations

from pathlib import Path

import torch

from quire.layers import quant_formats as qf
from quire.layers.prequantized import act_order, fp8
from quire.layers.prequantized.ints import canonical_int

from runtime_helpers import run_triton_interpreter_suite


def _reference(q, s, z, g_idx):
    return (q.float() - z[:, g_idx].float()) * s[:, g_idx]


def test_act_order_plan_sorts_columns_into_whole_groups():
    torch.manual_seed(0)
    g_idx = torch.randperm(256) // 64          # a full act-order map, groups of 64
    plan = act_order.plan(g_idx, int4=True)
    assert plan.group == 64 and not plan.padded
    assert torch.equal(g_idx[plan.perm], torch.repeat_interleave(plan.block_groups, 64))


def test_a_shard_with_uneven_groups_is_padded_and_computes_the_same():
    torch.manual_seed(1)
    g_idx = (torch.randperm(512) // 128)[:256]   # one rank's half: runs of ~64, uneven
    n, k = 16, 256
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    s = torch.rand(n, 4).half().float()
    z = torch.randint(0, 16, (n, 4))
    c = canonical_int(q, s, z, g_idx, 4, "test")
    assert c.kind == qf.INT4 and c.padded and c.tensors["qweight"].shape[1] * 2 % 32 == 0
    w = qf.dequantize_int4(*c.tensors.values())
    assert torch.equal(act_order.ungather_weight(w, c.perm, k), _reference(q, s, z, g_idx))
    x = torch.randn(3, k, dtype=torch.float64)
    y = act_order.gather_input(x, c.perm, c.padded) @ w.double().T
    assert torch.allclose(y, x @ _reference(q, s, z, g_idx).double().T, rtol=0, atol=1e-9)


def test_fp32_scales_whose_int4_zero_rounds_are_kept_as_exact_int8():
    torch.manual_seed(2)
    n, k = 8, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    s = torch.rand(n, 2) * 0.1                  # fp32 scales: (8 - z) * s rounds
    z = torch.randint(0, 16, (n, 2))
    c = canonical_int(q, s, z, None, 4, "test")
    assert c.kind == qf.INT8
    g_idx = torch.arange(k) // 32
    assert torch.equal(qf.dequantize_int8(*c.tensors.values()), _reference(q, s, z, g_idx))
    half = canonical_int(q, s.half().float(), z, None, 4, "test")  # fp16 scales: exact int4
    assert half.kind == qf.INT4
    assert torch.equal(qf.dequantize_int4(*half.tensors.values()),
                       _reference(q, s.half().float(), z, g_idx))


def test_fp8_cpu_kernel_widens_tiles_to_the_dequantized_product(monkeypatch):
    monkeypatch.setattr(fp8, "TILE_ELEMENTS", 64 * 40)  # several tiles, a ragged last one
    torch.manual_seed(3)
    w = (torch.randn(100, 64) * 30).to(fp8.FP8_DTYPE)
    scales = torch.rand(100, 1)
    kernel = fp8.kernel(w, scales)
    assert kernel.weight.dtype == fp8.FP8_DTYPE  # kept in 8 bits
    x = torch.randn(5, 64)
    assert torch.equal(kernel(x), x @ fp8.dequantize(w, scales).T)
    xb = x.bfloat16()
    assert torch.equal(kernel(xb), xb @ fp8.dequantize(w, scales, torch.bfloat16).T)


def test_triton_fp8_dequantize_in_the_interpreter(tmp_path):
    suite = Path(__file__).with_name("triton_fp8_suite.py")
    assert run_triton_interpreter_suite(suite, tmp_path) > 0
