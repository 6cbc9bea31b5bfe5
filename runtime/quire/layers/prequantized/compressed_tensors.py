"""compressed-tensors checkpoints (llm-compressor's output; quant_method
"compressed-tensors"): `config_groups` of schemes, each with `targets` and a `format`, and an
`ignore` list of modules left float. Weight-only ints and FP8 weights are read:

  pack-quantized   weight_packed int32 [N, K*b/32] (values q + 2^(b-1), lowest bits first),
                   weight_scale [N, K/G] (group) or [N, 1] (channel), asymmetric:
                   weight_zero_point int32 [N*b/32, K/G] (z + 2^(b-1), packed along N),
                   act-order: weight_g_idx [K]
  naive-quantized  weight int8 [N, K] (q), weight_scale, weight_zero_point int8 (z)
  float-quantized  weight float8_e4m3fn [N, K], weight_scale [1] (tensor), [N, 1] (channel)
                   or [N/bn, K/bk] (block); static activations: input_scale [1]
  w = (q - z) * scale  /  w = weight * weight_scale, computed in the scale's dtype by the
  library (bf16 scales: every weight rounded to bf16), which a float32 model matches
  (prequantized/base.py, _round_like_the_library)

Refused by name: activations quantized to ints (W4A4, W4A8, W8A8), FP4 / MX formats, 2:4
sparsity, transforms (rotations), KV-cache schemes, other bit widths and group sizes.
"""

from __future__ import annotations

import torch

from quire.layers import quant_formats as qf
from quire.layers.prequantized import fp8, packing
from quire.layers.prequantized.base import (
    LayerFormat,
    PrequantizedConfig,
    RawParam,
    UnsupportedScheme,
    checkpoint_modules,
    matches,
    part_sizes,
)
from quire.layers.prequantized.fp8_blocks import fp8_canonical, fp8_raw_params
from quire.layers.prequantized.ints import canonical_int

INT_FORMATS = ("pack-quantized", "naive-quantized")
SUPPORTED = ("weight-only int4/int8 (W4A16, W4A16_ASYM, W8A16: pack-quantized or "
             "naive-quantized, group or channel) and FP8 weights (FP8, FP8_DYNAMIC, FP8_BLOCK: "
             "float-quantized)")


def _refuse(what: str) -> UnsupportedScheme:
    return UnsupportedScheme(f"compressed-tensors: {what} is not supported; supported: "
                             f"{SUPPORTED}")


def scheme_name(weights: dict, acts: dict | None) -> str:
    """'W4A4', 'W8A16', 'NVFP4 (fp4 weights)': the preset naming, for messages."""
    def bits(args, default):
        if not args:
            return default
        kind = "FP" if args.get("type") == "float" else ""
        return f"{kind}{args.get('num_bits')}"
    return f"W{bits(weights, '16')}A{bits(acts, '16')}"


class Scheme:
    """One config group's weights (and activations) as Quire reads them (hashable, so the
    parts of a fused layer can be compared)."""

    def __init__(self, group: dict, fmt: str | None) -> None:
        w, a = group.get("weights"), group.get("input_activations")
        name = scheme_name(w or {}, a)
        if group.get("output_activations"):
            raise _refuse(f"output activation quantization ({name})")
        if not w:
            raise _refuse(f"a scheme without quantized weights ({name})")
        self.fmt = group.get("format") or fmt
        self.type, self.bits = w.get("type", "int"), w.get("num_bits")
        self.strategy, self.group = w.get("strategy"), w.get("group_size")
        self.symmetric = w.get("symmetric", True)
        self.block = tuple(w.get("block_structure") or ()) or None
        self.actorder = w.get("actorder")
        self.dynamic_acts = bool(a and a.get("dynamic"))
        self.static_acts = bool(a) and not self.dynamic_acts
        if w.get("dynamic"):
            raise _refuse(f"dynamic weight quantization ({name})")
        if self.type == "float":
            if self.bits != 8 or self.fmt != "float-quantized":
                raise _refuse(f"scheme {name} in format {self.fmt}")
            if a and (a.get("type") != "float" or a.get("num_bits") != 8):
                raise _refuse(f"scheme {name} (FP8 weights with non-FP8 activations)")
            if self.strategy not in ("tensor", "channel", "block"):
                raise _refuse(f"FP8 weights with strategy {self.strategy!r} ({name})")
            if self.strategy == "block" and (not self.block or len(self.block) != 2):
                raise _refuse(f"FP8 block_structure {self.block!r} ({name})")
            return
        if a:  # integer weights: activations must stay float
            raise _refuse(f"scheme {name} (activations quantized to "
                          f"{a.get('type', 'int')}{a.get('num_bits')})")
        if self.fmt not in INT_FORMATS:
            raise _refuse(f"format {self.fmt!r} for {name}")
        if self.bits not in (4, 8):
            raise _refuse(f"{self.bits}-bit weights ({name})")
        if self.bits == 8 and not self.symmetric:  # as vLLM: zero points only for 4-bit
            raise _refuse(f"asymmetric 8-bit weights ({name}, zero points)")
        if self.strategy == "group":
            if not isinstance(self.group, int) or self.group <= 0 or self.group % 32:
                raise _refuse(f"group size {self.group} ({name})")
        elif self.strategy != "channel":
            raise _refuse(f"int weights with strategy {self.strategy!r} ({name})")
        if self.actorder not in (None, "group", "weight", "static", "dynamic"):
            raise _refuse(f"actorder {self.actorder!r} ({name})")

    def key(self):
        return (self.fmt, self.type, self.bits, self.strategy, self.group, self.symmetric,
                self.block, self.actorder, self.static_acts)

    def __eq__(self, other):
        return isinstance(other, Scheme) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())


class IntFormat(LayerFormat):
    dequantizes_in_scale_dtype = True  # compressed-tensors' _dequantize: base.py says why

    def __init__(self, scheme: Scheme, has_g_idx: bool) -> None:
        self.s, self.has_g_idx = scheme, has_g_idx
        self.kind = qf.INT4 if scheme.bits == 4 else qf.INT8

    def raw_params(self, layer, k, n):
        s = self.s
        group = s.group if s.strategy == "group" else k
        if k % group:
            raise UnsupportedScheme(f"{layer.prefix}: compressed-tensors group size {group} "
                                    f"does not divide this rank's input size {k}; use a "
                                    "tensor-parallel size that leaves whole groups")
        groups = k // group
        f = 32 // s.bits
        if s.fmt == "pack-quantized":
            if k % f or (not s.symmetric and n % f):
                raise UnsupportedScheme(f"{layer.prefix}: pack-quantized {s.bits}-bit packs "
                                        f"{f} values a word; shape [{n}, {k}] does not divide")
            params = [RawParam("weight_packed", (n, k // f), torch.int32, output_dim=0,
                               input_dim=1, packed_dim=1, pack_factor=f)]
            zp = RawParam("weight_zero_point", (n // f, groups), torch.int32, output_dim=0,
                          input_dim=1, packed_dim=0, pack_factor=f)
        else:
            params = [RawParam("weight", (n, k), torch.int8, output_dim=0, input_dim=1)]
            zp = RawParam("weight_zero_point", (n, groups), torch.int8, output_dim=0,
                          input_dim=1)
        input_dim = 1 if s.strategy == "group" else None
        params.append(RawParam("weight_scale", (n, groups), torch.float32, output_dim=0,
                               input_dim=input_dim))
        if not s.symmetric:
            params.append(zp)
        if self.has_g_idx:
            params.append(RawParam("weight_g_idx", (k,), torch.int32, input_dim=0,
                                   per_part=True))
        return params

    def canonical(self, layer, raw):
        s, offset = self.s, 1 << (self.s.bits - 1)
        if s.fmt == "pack-quantized":
            q = packing.unpack_int32(raw["weight_packed"], s.bits, dim=1)
            zeros = raw.get("weight_zero_point")
            if zeros is not None:
                zeros = packing.unpack_int32(zeros, s.bits, dim=0).to(torch.int16)
        else:
            q = (raw["weight"].to(torch.int16) + offset).to(torch.uint8)
            zeros = raw.get("weight_zero_point")
            if zeros is not None:
                zeros = zeros.to(torch.int16) + offset
        g_idx = None
        if "weight_g_idx" in raw:
            per_part = raw["weight_g_idx"].long()
            if not bool((per_part == per_part[0]).all()):
                raise UnsupportedScheme(f"{layer.prefix}: the act-order g_idx of its fused "
                                        "parts differ; supported: one order for all")
            g_idx = per_part[0]
            if bool((g_idx == -1).any()):  # written before calibration: the plain order
                g_idx = None
        return canonical_int(q, raw["weight_scale"], zeros, g_idx, s.bits, layer.prefix)


class FloatFormat(LayerFormat):
    kind = fp8.FP8
    dequantizes_in_scale_dtype = True

    def __init__(self, scheme: Scheme) -> None:
        self.s = scheme

    def raw_params(self, layer, k, n):
        s = self.s
        return fp8_raw_params(layer, k, n, "weight_scale",
                              s.block if s.strategy == "block" else None,
                              s.strategy == "tensor", s.static_acts)

    def canonical(self, layer, raw):
        return fp8_canonical(layer, raw["weight"], raw["weight_scale"], raw.get("input_scale"),
                             part_sizes(layer))


class CompressedTensorsConfig(PrequantizedConfig):
    name = "compressed-tensors"

    def __init__(self, qcfg, tensor_names):
        super().__init__(qcfg, tensor_names)
        sparsity = qcfg.get("sparsity_config") or {}
        if sparsity:
            fmt = sparsity.get("format", "?")
            raise _refuse(f"sparsity ({fmt}, e.g. 2:4 structured)")
        if qcfg.get("transform_config"):
            raise _refuse("a transform_config (rotations such as SpinQuant / QuIP)")
        if qcfg.get("kv_cache_scheme"):
            raise _refuse("a kv_cache_scheme (use --kv-cache-dtype for an FP8 KV cache)")
        status = qcfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise _refuse(f"quantization_status {status!r} (weights not stored compressed)")
        fmt = qcfg.get("format")
        self.groups = []
        for name, group in (qcfg.get("config_groups") or {}).items():
            targets = group.get("targets") or []
            bad = [t for t in targets if t not in ("Linear",) and not t.startswith("re:")
                   and "." not in t]
            if bad:
                raise _refuse(f"config group {name}'s targets {bad} (module classes other "
                              "than Linear)")
            self.groups.append((targets, Scheme(group, fmt)))
        self.ignore = list(qcfg.get("ignore") or [])

    def scheme_for(self, module):
        if any(matches(module, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or matches(module, t) for t in targets):
                marker = ("weight_packed" if scheme.fmt == "pack-quantized"
                          else "weight_scale")
                # targets name Linear modules; one that the checkpoint left float (an
                # embedding, a module the tool skipped) has no quantized tensors
                return scheme if self.has(module, marker) else None
        return None

    def layer_format(self, scheme, prefix):
        if scheme.type == "float":
            return FloatFormat(scheme)
        has_g_idx = all(self.has(m, "weight_g_idx") for m in checkpoint_modules(prefix))
        return IntFormat(scheme, has_g_idx)
