"""A GGUF's quantized blocks as Quire's canonical int8 / int4 tensors (layers/quant_formats.py),
with the same dequantized values as the file: integers and scales are read from the blocks,
never through a float (let alone bf16) round trip.

    Q8_0  w = q * d                  -> int8, G = 32, scale = d
    Q5_0  w = (q - 16) * d           -> int8, G = 32, scale = d
    Q6_K  w = d * sc * (q - 32)      -> int8, G = 16, scale = d * sc (exact in fp32)
    Q4_0  w = (q - 8) * d            -> int4, G = 32, scale = d, zero = 0
    Q4_1  w = q * d + m              -> int4, G = 32, scale = d, zero = m + 8d
    Q4_K  w = d * sc * q - dmin * m  -> int4, G = 32, scale = d * sc, zero = 8 * scale - dmin * m

gguf.quants computes each w in fp32 as one rounding of an exact product plus (for Q4_1/Q4_K)
one rounding of a sum; (q - 8) * scale + zero is then the same single rounding whenever the
zero itself is exact in fp32 (checked per tensor: `inexact_zeros`, logged; the values are then
within one fp32 ulp). Other quantized types (Q5_1, Q5_K, Q2_K, Q3_K, IQ*) are dequantized by
gguf.quants and re-quantized to int8 per output channel, with a warning; float tensors stay
float. The parts of one fused layer (q/k/v, gate/up) share a format: groups of different sizes
are brought to their gcd (scales repeated, exact); parts of different kinds leave the layer
float (the file's dequantized values, fp32), with a warning.

`plan(reader)` decides every layer's format from the tensor types alone (cheap; the model is
built from it), `iter_tensors(reader, cfg, plan)` then yields (transformers name, tensor).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import torch

from quire.layers import quant_formats as qf

logger = logging.getLogger(__name__)

# GGUF type name -> (canonical kind, group size) where the mapping is exact
EXACT = {"Q8_0": (qf.INT8, 32), "Q5_0": (qf.INT8, 32), "Q6_K": (qf.INT8, 16),
         "Q4_0": (qf.INT4, 32), "Q4_1": (qf.INT4, 32), "Q4_K": (qf.INT4, 32)}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

# transformers module (per layer) -> our layer; the parts of one fused layer share a format
_OUR_LAYER = {"self_attn.q_proj": "qkv_proj", "self_attn.k_proj": "qkv_proj",
              "self_attn.v_proj": "qkv_proj", "self_attn.o_proj": "o_proj",
              "mlp.gate_proj": "gate_up_proj", "mlp.up_proj": "gate_up_proj",
              "mlp.down_proj": "down_proj"}


def our_layer(hf_name: str) -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' -> 'layers.3.qkv_proj'; the embedding and
    LM head -> 'embed_tokens' / 'lm_head'; others (norms) -> None."""
    name = hf_name.removeprefix("model.").removesuffix(".weight")
    if name in ("embed_tokens", "lm_head"):
        return name
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if rest in _OUR_LAYER:
            return f"layers.{idx}.{_OUR_LAYER[rest]}"
    return None


def tensor_format(type_name: str) -> tuple[str, int | None]:
    """(kind, group) a GGUF tensor type becomes: exact where EXACT says, float for float
    types, else int8 per output channel (group None) re-quantized from the dequantized
    values."""
    if type_name in EXACT:
        return EXACT[type_name]
    if type_name in FLOAT_TYPES:
        return "none", None
    return qf.INT8, None


def plan(reader, hf_name_of) -> dict[str, dict]:
    """{our layer prefix: {"method", "group_size", "gguf_types"}} for every linear-like
    tensor of the file (hf_name_of maps a GGUF tensor name to its transformers name)."""
    parts: dict[str, list[tuple[str, str, int]]] = {}
    for tensor in reader.tensors:
        hf = hf_name_of(tensor.name)
        layer = our_layer(hf) if hf and hf.endswith(".weight") else None
        if layer is None:
            continue
        type_name = tensor.tensor_type.name
        kind, group = tensor_format(type_name)
        k = int(tensor.shape[0])  # GGUF lists the input (fastest) dim first
        parts.setdefault(layer, []).append((type_name, kind, group or k))
    out = {}
    for layer, entries in parts.items():
        kinds = {kind for _, kind, _ in entries}
        types = sorted({t for t, _, _ in entries})
        if len(kinds) > 1:
            logger.warning("%s: its fused parts are %s, which share no exact format; it "
                           "stays float (the file's dequantized values)", layer, types)
            out[layer] = {"method": "none", "group_size": None, "gguf_types": types}
            continue
        kind = kinds.pop()
        inexact = [t for t in types if t not in EXACT and t not in FLOAT_TYPES]
        if inexact:
            logger.warning("%s: GGUF type %s has no exact int8/int4 form here; dequantized "
                           "and re-quantized to int8 per output channel", layer, inexact)
        group = math.gcd(*(g for _, _, g in entries)) if kind != "none" else None
        out[layer] = {"method": kind, "group_size": group, "gguf_types": types}
    return out


# --- reading the blocks --------------------------------------------------------------------
def _blocks(tensor) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES
    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _integers_by_dequantizing(blocks: np.ndarray, qtype, unit_fields) -> np.ndarray:
    """The blocks' integers, read by gguf's own dequantizer after setting every scale field
    to 1 and every min to 0 (so no bit layout is re-implemented here)."""
    from gguf.quants import dequantize
    b = blocks.copy()
    for start, stop, value in unit_fields:
        b[:, start:stop] = np.frombuffer(value, dtype=np.uint8)
    return np.rint(dequantize(b, qtype)).astype(np.int16)


_ONE16 = np.float16(1.0).tobytes()


def decode(tensor) -> tuple[str, dict[str, np.ndarray], int]:
    """(kind, {"q": ints [N, K], "scales": [N, K//G], "zeros"?: ...}, G) for an EXACT type.
    q is signed (the value times scale) for int8 and 0..15 for int4."""
    from gguf import GGMLQuantizationType as T
    t = tensor.tensor_type
    k = int(tensor.shape[0])
    n = int(np.prod([int(d) for d in tensor.shape[1:]]))
    b = _blocks(tensor)
    if t == T.Q8_0:
        q, s = b[:, 2:].view(np.int8).astype(np.int16), _f16(b[:, :2])
        out = {"q": q, "scales": s}
    elif t == T.Q5_0:
        q = _integers_by_dequantizing(b, t, [(0, 2, _ONE16)])
        out = {"q": q, "scales": _f16(b[:, :2])}
    elif t == T.Q6_K:  # ql[128] qh[64] scales int8[16] d f16
        q = _integers_by_dequantizing(b, t, [(192, 208, b"\x01" * 16), (208, 210, _ONE16)])
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        out = {"q": q, "scales": _f16(b[:, 208:210]) * sc}
    elif t in (T.Q4_0, T.Q4_1):
        start = 2 if t == T.Q4_0 else 4
        qs = b[:, start:start + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int16)
        d = _f16(b[:, :2])
        zeros = (_exact_sum(_f16(b[:, 2:4]), 8.0 * d, tensor.name) if t == T.Q4_1
                 else np.zeros_like(d))  # Q4_0 is already (q - 8) * d
        out = {"q": q, "scales": d, "zeros": zeros}
    elif t == T.Q4_K:  # d f16, dmin f16, scales[12], qs[128]
        from gguf.quants import Q4_K
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 256).astype(np.int16)
        scale = d * sc.astype(np.float32)
        out = {"q": q, "scales": scale,
               "zeros": _exact_sum(8.0 * scale, -(dmin * mn.astype(np.float32)), tensor.name)}
    else:
        raise ValueError(f"{tensor.name}: GGUF type {t.name} has no exact canonical form")
    kind, group = EXACT[t.name]
    result = {key: v.reshape(n, -1) for key, v in out.items()}
    assert result["q"].shape == (n, k) and result["scales"].shape == (n, k // group)
    return kind, result, group


def _exact_sum(a: np.ndarray, b: np.ndarray, name: str) -> np.ndarray:
    """a + b in fp32, logging where fp32 rounds it (then w may differ by one fp32 ulp)."""
    s = a + b
    inexact = int(np.count_nonzero(s.astype(np.float64)
                                   != a.astype(np.float64) + b.astype(np.float64)))
    if inexact:
        logger.info("%s: %d of %d int4 zeros are rounded in fp32 (those groups' values may "
                    "differ from the file by one fp32 ulp)", name, inexact, s.size)
    return s


def canonical(kind: str, parts: dict[str, np.ndarray], group: int,
              layer_group: int) -> dict[str, torch.Tensor]:
    """The decoded integers and scales as the canonical tensors at the layer's group size
    (a divisor of the tensor's own: scales repeated)."""
    rep = group // layer_group
    out = {"scales": torch.from_numpy(np.repeat(parts["scales"], rep, axis=1).astype(np.float32))}
    if kind == qf.INT8:
        out["qweight"] = torch.from_numpy(parts["q"].astype(np.int8))
    else:
        out["qweight"] = qf.pack_nibbles(torch.from_numpy(parts["q"].astype(np.uint8)))
        out["zeros"] = torch.from_numpy(np.repeat(parts["zeros"], rep, axis=1).astype(np.float32))
    return out


def iter_tensors(reader, layers_plan: dict[str, dict], hf_name_of, unpermute,
                 dequantize_float) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor): "x.qweight" / "x.scales" / "x.zeros" for a quantized
    layer's weight, the dequantized fp32 "x.weight" for everything else. `unpermute(name,
    array)` undoes llama.cpp's Q/K row permutation (rows are whole output channels, so it
    applies to the integers and the scales alike); `dequantize_float(tensor)` is the float
    path's fp32 [N, K] array."""
    for tensor in reader.tensors:
        hf = hf_name_of(tensor.name)
        if hf is None:
            continue
        layer = our_layer(hf) if hf.endswith(".weight") else None
        entry = layers_plan.get(layer) if layer else None
        if entry is None or entry["method"] == "none":
            w = unpermute(hf, dequantize_float(tensor))
            yield hf, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
            continue
        base = hf.removesuffix(".weight")
        if tensor.tensor_type.name in EXACT:
            kind, parts, group = decode(tensor)
            tensors = canonical(kind, parts, group, entry["group_size"])
        else:  # no exact form: re-quantize the dequantized values (int8 per channel)
            w = torch.from_numpy(np.ascontiguousarray(dequantize_float(tensor),
                                                      dtype=np.float32))
            q, s = qf.quantize_int8(w, entry["group_size"])
            tensors = {"qweight": q, "scales": s}
        for key, t in tensors.items():
            yield f"{base}.{key}", torch.from_numpy(
                np.ascontiguousarray(unpermute(hf, t.numpy())))
