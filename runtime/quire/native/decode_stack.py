"""A decode-only step's decoder layers in one native call (native/decode_stack.cpp).

At batch 1 the Python path issues ~10 kernel calls per layer through ctypes, plus the views,
splits and allocations around them: more time than reading the weights. Where every linear
runs a native kernel (quantized: GGUF `auto`, int8, int4; or a bfloat16 float weight's), the
KV cache holds the model's dtype and the fused element-wise kernels are built, `DecodeStack.run` calls the same kernels
in the same order from C++: the output is bit-identical to the Python path (the test checks
it), only the orchestration moved. Anything else (float32 weights, LoRA, tensor parallelism,
biases, fp8 KV, attention soft-capping or sinks, partial rotary or per-layer RoPE kinds, a step
with prefill tokens, dynamic RoPE on a long sequence) keeps the Python path. QUIRE_DECODE_STACK=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from quire.native import fused_ops, loader, paged_attention, quant_matmul

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P),
                ("gate_up", _P), ("down", _P), ("k_cache", _P), ("v_cache", _P),
                ("window", _I64)]


class _Model(ctypes.Structure):
    _fields_ = [("dtype", _I64), ("width", _I64), ("num_layers", _I64), ("hidden", _I64),
                ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layers", _P), ("rms_norm", _P), ("rope", _P),
                ("silu_and_mul", _P), ("paged_decode", _P), ("linear", _P), ("exp_fn", _P),
                ("timings", _P)]


PHASES = ("input norm", "qkv_proj", "rope", "kv write", "attention", "o_proj",
          "post norm", "gate_up_proj", "silu_and_mul", "down_proj")


@functools.cache
def _library():
    lib = loader.load_library("decode_stack.cpp")
    if lib is None:
        return None
    fn = lib.quire_decode_stack
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _P, _I64, ctypes.c_int]
    return fn


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _packed(linear) -> quant_matmul.PackedWeight | None:
    """The layer's native packed weight, or None where it runs anything else."""
    # a quantized layer's kernel, or a bfloat16 float layer's (quant_kernels.DenseBf16Kernel)
    kernel = getattr(linear, "quant_kernel", None) or getattr(linear, "native_kernel", None)
    packed = getattr(kernel, "packed", None)
    if (not isinstance(packed, quant_matmul.PackedWeight) or packed._fn is None
            or linear.bias is not None or linear.lora is not None or linear.tp_size != 1
            # act-order checkpoints gather x's columns first (layers/prequantized/act_order.py)
            or getattr(linear, "input_perm", None) is not None):
        return None
    return packed


class DecodeStack:
    """Built once the weights are packed and the KV cache is allocated; `run` serves every
    decode-only step it `accepts`."""

    def __init__(self, model, fn, refs, struct) -> None:
        self.model, self.fn = model, fn
        self._refs = refs          # what the struct points into (weights, KV cache): kept alive
        self._struct = struct
        self._address = ctypes.addressof(struct)
        self.dtype = model.layers[0].input_layernorm.weight.dtype
        self._timings: torch.Tensor | None = None

    def profile(self, on: bool = True) -> None:
        """Start (from zero) or stop adding each phase's seconds up (`timings`)."""
        self._timings = torch.zeros(len(PHASES), dtype=torch.float64) if on else None
        self._struct.timings = self._timings.data_ptr() if on else None

    def timings(self) -> dict[str, float]:
        """Seconds per phase, summed over the layers and the steps since `profile()`."""
        if self._timings is None:
            return {}
        return dict(zip(PHASES, self._timings.tolist()))

    @classmethod
    def build(cls, model, kv_caches, layer_type: type) -> DecodeStack | None:
        """The stack for this model and cache, or None where a condition above fails.
        `layer_type`: the plain decoder layer the native stack reproduces (llama.py's): a
        model of any other layer class keeps the Python path."""
        if os.environ.get("QUIRE_DECODE_STACK", "1") == "0":
            return None
        fn = _library()
        native = fused_ops._native()
        if fn is None or native is None or native[2] is None:
            return None
        lib, width, exp_fn = native
        cfg = model.cfg
        if not len(model.layers) or any(type(layer) is not layer_type for layer in model.layers):
            return None
        first = model.layers[0]
        dtype = first.input_layernorm.weight.dtype
        if (dtype not in (torch.float32, torch.bfloat16) or cfg.hidden_size > 8192
                or cfg.intermediate_size > 16384 or len(model.layers) != len(kv_caches)):
            return None
        # the native stack rotates every head dim with one table: no partial rotary (Phi-3's
        # partial_rotary_factor read past each row of the table) and no per-layer RoPE kinds
        ropes = getattr(model, "ropes", None) or {"global": model.rope}
        if any(r is not model.rope for r in ropes.values()) \
                or model.rope.rotary_dim != first.head_dim:
            return None
        # the native stack passes no soft-capping and no sinks to the attention kernel
        if any(b.name != "torch" or b.logit_softcap is not None for b in model.backends.values()) \
                or any(getattr(layer, "sinks", None) is not None for layer in model.layers):
            return None
        decode_lib = paged_attention._library()  # quire_paged_decode, built with its library
        if decode_lib is None:
            return None
        layers, refs = (_Layer * len(model.layers))(), []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches)):
            parts = [_packed(getattr(layer, n))
                     for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (any(p is None for p in parts) or k_cache.dtype != dtype
                    or v_cache.dtype != dtype or not k_cache.is_contiguous()
                    or not v_cache.is_contiguous() or k_cache.device.type != "cpu"
                    or any(n.dtype != dtype or not n.is_contiguous() for n in norms)
                    or layer.k_scale != 1.0 or layer.v_scale != 1.0
                    or layer.backend.scale != first.backend.scale
                    or layer.input_layernorm.eps != first.input_layernorm.eps
                    or layer.post_attention_layernorm.eps != first.input_layernorm.eps):
                return None
            refs += [*parts, *norms, k_cache, v_cache]
            layers[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(),
                               *(p._address for p in parts), k_cache.data_ptr(),
                               v_cache.data_ptr(), layer.backend.sliding_window or 0)
        struct = _Model(
            {torch.float32: 0, torch.bfloat16: 1}[dtype], width, len(model.layers),
            cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
            cfg.intermediate_size, kv_caches[0][0].shape[1], first.input_layernorm.eps,
            first.backend.scale, ctypes.addressof(layers), _address(lib.quire_rms_norm),
            _address(lib.quire_rope), _address(lib.quire_silu_and_mul), _address(decode_lib),
            _address(parts[0]._fn), exp_fn, None)
        refs.append(layers)
        logger.info("decode steps run their %d decoder layers in one native call",
                    len(model.layers))
        return cls(model, fn, refs, struct)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                 rope_seq_lens: torch.Tensor | None = None) -> torch.Tensor | None:
        """LlamaForCausalLM.forward's result for a decode-only step (before the final norm),
        or None where this step is not one it serves (the caller runs the model then)."""
        if not meta.num_decodes == input_ids.shape[0] > 0:
            return None
        cos, sin = self.model.rope.cos_sin(positions, rope_seq_lens)
        if (cos.dtype != self.dtype or sin.dtype != self.dtype or cos.stride(-1) != 1
                or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
                or meta.block_tables.stride(1) != 1 or meta.slot_mapping.dtype != torch.int64
                or meta.block_tables.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32):
            return None
        x = self.model.embed_tokens(input_ids).contiguous()
        residual = torch.empty_like(x)
        slots = meta.slot_mapping.contiguous()
        seq_lens = meta.seq_lens.contiguous()
        rc = self.fn(self._address, x.data_ptr(), residual.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), cos.stride(0), slots.data_ptr(),
                     meta.block_tables.data_ptr(), meta.block_tables.stride(0),
                     seq_lens.data_ptr(), x.shape[0], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"decode_stack: native step {rc} failed")
        return residual.add_(x)
