"""GGUF blocks become canonical int8/int4 tensors with the file's own dequantized values:
dequant(canonical) == gguf.quants.dequantize(blocks), bit for bit, except where an int4 zero
(m + 8d, or 8 d sc - dmin m) is not exact in fp32: there the value may differ by one fp32
ulp (the repack logs how many groups; the default model has none)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from quire.layers import quant_formats as qf
from quire.models import gguf_repack
from quire.models.loader import _gguf_to_hf_name, default_model_path, read_gguf

T = GGMLQuantizationType


def _fake_tensor(qtype, n, k, seed=0):
    """A GGUF tensor of n rows of k values: blocks made by gguf's own quantizer where it has
    one, else random bytes with sane fp16 scale fields (every bit pattern of the integers is
    then exercised)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[0, :32] += 0.3  # one block with an offset, so Q4_1's min is far from zero
        data = quantize(w, qtype)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
        f16 = (rng.uniform(0.5, 2.0, (n * k // block, 2)) * 1e-3).astype(np.float16)
        if qtype == T.Q4_K:
            data[:, 0:4] = f16.view(np.uint8)
        else:  # Q6_K: d last
            data[:, 208:210] = f16[:, :1].view(np.uint8)
        data = data.reshape(n, -1)
    return types.SimpleNamespace(name=f"blk.0.{qtype.name}", tensor_type=qtype,
                                 shape=np.array([k, n]), data=data)


def _dequantized_canonical(tensor):
    kind, parts, group = gguf_repack.decode(tensor)
    t = gguf_repack.canonical(kind, parts, group, group)
    if kind == qf.INT8:
        return qf.dequantize_int8(t["qweight"], t["scales"]).numpy(), kind, group
    return qf.dequantize_int4(t["qweight"], t["scales"], t["zeros"]).numpy(), kind, group


def _ulps(a, b):
    """Distance in fp32 steps; equal values count 0 (Q4_0 with a negative d makes -0.0 where
    (q - 8) * d + 0 makes +0.0)."""
    steps = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))
    return np.where(a == b, 0, steps)


@pytest.mark.parametrize("qtype,kind,group", [(T.Q8_0, "int8", 32), (T.Q5_0, "int8", 32),
                                              (T.Q6_K, "int8", 16), (T.Q4_0, "int4", 32),
                                              (T.Q4_1, "int4", 32), (T.Q4_K, "int4", 32)])
def test_repacked_values_are_the_files(qtype, kind, group):
    n, k = 8, 512
    tensor = _fake_tensor(qtype, n, k)
    got, got_kind, got_group = _dequantized_canonical(tensor)
    want = dequantize(tensor.data, qtype).reshape(n, k)
    assert (got_kind, got_group) == (kind, group)
    ulps = _ulps(got, want)
    if qtype in (T.Q4_1, T.Q4_K):  # sums: exact where the zero is exact in fp32
        assert ulps.max() <= 1
        print(f"{qtype.name}: {np.count_nonzero(ulps)} of {ulps.size} values one ulp off")
    else:
        assert ulps.max() == 0


def test_default_model_blocks_repack_exactly():
    """SmolLM2's own file: Q4_1 layers and the Q8_0 embedding, bit for bit."""
    reader = read_gguf(default_model_path())
    picked = [t for t in reader.tensors if t.name.startswith("blk.0.") and t.name.endswith(
        "weight") and t.tensor_type.name != "F32"]
    picked += [t for t in reader.tensors if t.name == "token_embd.weight"]
    assert {t.tensor_type.name for t in picked} == {"Q4_1", "Q8_0"}
    for tensor in picked:
        got, _, _ = _dequantized_canonical(tensor)
        want = dequantize(tensor.data, tensor.tensor_type).reshape(got.shape)
        assert _ulps(got, want).max() == 0, tensor.name


def test_plan_of_the_default_model():
    plan = gguf_repack.plan(read_gguf(default_model_path()), _gguf_to_hf_name)
    assert plan["embed_tokens"] == {"method": "int8", "group_size": 32, "gguf_types": ["Q8_0"]}
    assert plan["layers.0.qkv_proj"]["method"] == "int4"
    assert plan["layers.29.down_proj"] == {"method": "int4", "group_size": 32,
                                           "gguf_types": ["Q4_1"]}
    assert "lm_head" not in plan  # tied: the head is the embedding


def _plan_of(types_by_name):
    tensors = [types.SimpleNamespace(name=name, tensor_type=T[t], shape=np.array([64, 32]))
               for name, t in types_by_name.items()]
    return gguf_repack.plan(types.SimpleNamespace(tensors=tensors), _gguf_to_hf_name)


def test_fused_parts_share_one_format():
    plan = _plan_of({"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_0",
                     "blk.0.attn_v.weight": "Q4_1",
                     "blk.0.ffn_gate.weight": "Q8_0", "blk.0.ffn_up.weight": "Q6_K",
                     "blk.0.ffn_down.weight": "Q5_K", "blk.0.attn_output.weight": "F16"})
    assert plan["layers.0.qkv_proj"]["method"] == "int4"
    assert plan["layers.0.gate_up_proj"] == {"method": "int8", "group_size": 16,
                                             "gguf_types": ["Q6_K", "Q8_0"]}
    assert plan["layers.0.down_proj"]["method"] == "int8"  # re-quantized, per channel
    assert plan["layers.0.down_proj"]["group_size"] == 64
    assert plan["layers.0.o_proj"]["method"] == "none"
    mixed = _plan_of({"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q8_0",
                      "blk.0.attn_v.weight": "Q8_0"})
    assert mixed["layers.0.qkv_proj"]["method"] == "none"  # no exact common format


def test_smaller_layer_group_repeats_the_scales_exactly():
    tensor = _fake_tensor(T.Q8_0, 4, 128)
    kind, parts, group = gguf_repack.decode(tensor)
    t16 = gguf_repack.canonical(kind, parts, group, 16)
    t32 = gguf_repack.canonical(kind, parts, group, 32)
    assert t16["scales"].shape == (4, 8)
    assert torch.equal(qf.dequantize_int8(t16["qweight"], t16["scales"]),
                       qf.dequantize_int8(t32["qweight"], t32["scales"]))
