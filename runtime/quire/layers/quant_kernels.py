"""Weight-only int8 / int4 matmul kernels behind one interface, picked once per layer.

    kernel = int8_kernel(qweight, scales, exact=...)   # or int4_kernel(qweight, scales, zeros)
    y = kernel(x)          # (x.float() @ dequant(W).T).to(x.dtype), x [M, K]

In order of preference (benchmarks/quant_kernels.py prints each one's us/call and GB/s):
1. the native CPU kernels (native/quant_matmul.py: AVX-512 VNNI / AVX2), on
   the canonical fp32 scales, so exact wherever the format promises it; a prefill's rows of
   bfloat16 x go to the CPU's matrix engine where it has one (native/matrix_engine.py:
   AMX through oneDNN, the weight rounded to bfloat16);
2. torch's own weight-only ops (_weight_int8pack_mm per output channel,
   _weight_int4pack_mm_for_cpu group-wise). They take their scales (and zeros) in the
   activation dtype, i.e. rounded to bf16 in a bf16 model: allowed only where no exactness
   is promised (`exact=False`: quantized on load from float), never for a GGUF's own values;
3. the Triton kernels on CUDA (layers/triton_quant.py);
4. dequantize once, then an fp32 matmul: always right, but the weight then takes fp32
   memory (a warning says so once); kept for machines where no quantized kernel runs.
"""

from __future__ import annotations

import logging

import torch

from quire.layers import quant_formats as qf
from quire.layers.quant_formats import dequantize_int4, dequantize_int8, unpack_nibbles
from quire.layers.quant_kernel_base import Kernel
from quire.native import matrix_engine

logger = logging.getLogger(__name__)


def native():
    """The native kernel module when it is built and usable here, else None."""
    try:
        from quire.native import quant_matmul
    except ImportError:
        return None
    try:
        return quant_matmul if quant_matmul.available() else None
    except Exception as e:  # a failed build must not stop the model from loading
        logger.warning("native quantized matmul unavailable (%s)", e)
        return None


_warned = False


class DequantMatmul(Kernel):
    """Reference path: the fp32 weight dequantized once (on first use), then x.float() @ W.T
    (exactly the semantics every kernel promises)."""

    name = "dequant"

    def __init__(self, dequantize_fn, *tensors) -> None:
        self.dequantize_fn, self.tensors, self.weight = dequantize_fn, tensors, None

    def __call__(self, x):
        if self.weight is None:
            global _warned
            if not _warned:
                _warned = True
                logger.warning("no quantized matmul kernel runs here; quantized layers are "
                               "dequantized to fp32 (correct, but no memory saved)")
            self.weight = self.dequantize_fn(*self.tensors)
        return (x.float() @ self.weight.T).to(x.dtype)

    def dequantize(self):
        return self.weight if self.weight is not None else self.dequantize_fn(*self.tensors)


class NativeKernel(Kernel):
    owns_weights = True

    def __init__(self, name, module, fn, packed) -> None:
        self.name, self.module, self.fn, self.packed = name, module, fn, packed

    def __call__(self, x):
        # a prefill's many bfloat16 rows: the CPU's matrix engine, where it has one
        if x.dtype is torch.bfloat16 and matrix_engine.wants(x, self.packed, self.fn):
            return matrix_engine.linear(x, self.packed)
        if x.dtype in (torch.float32, torch.bfloat16):
            return self.fn(x, self.packed)
        return self.fn(x.float(), self.packed).to(x.dtype)  # it takes fp32 or bf16 only

    def silu_and_mul(self, x):
        if x.dtype is torch.bfloat16 and matrix_engine.wants(x, self.packed, self.fn):
            return matrix_engine.silu_and_mul(x, self.packed)
        return None

    def dequantize(self):
        return self.module.dequantize(self.packed)


class DenseBf16Kernel(Kernel):
    """A bfloat16 float weight in the native kernel's layout (quant_matmul.pack_bf16), for a
    bfloat16 model on the CPU: decode and verification rows read it once through the vector
    units (oneDNN's bfloat16 GEMV read it at about a third of the bandwidth: issue 48's 30
    tok/s against 151 quantized), and the decode stack can take the layer. Prefill chunks
    (64+ rows) go to matrix_engine.linear where oneDNN has bfloat16 kernels (AMX,
    AVX512-BF16): on an AMX build the library's own tiles, which only interleave the weight's
    pairs in cache (a gated MLP's gate|up with the SiLU in their epilogue: silu_and_mul),
    elsewhere a scratch unblocked for torch's F.linear; without such kernels (AVX2: torch's
    bfloat16 matmul is emulated there) the native kernel's expanded tiles. The weight is
    exact on every road (bfloat16 products, float32 sums); one copy is kept."""

    name = "native-bf16"
    owns_weights = True

    def __init__(self, module, packed) -> None:
        self.module, self.packed = module, packed  # module: native/quant_matmul

    def _prefill(self, x) -> bool:
        return (x.dtype is torch.bfloat16 and x.dim() == 2
                and x.shape[0] >= matrix_engine.MIN_ROWS and matrix_engine.onednn_bf16())

    def __call__(self, x):
        if self._prefill(x):
            return matrix_engine.linear(x, self.packed)
        return self.module.bf16_linear(x, self.packed)

    def silu_and_mul(self, x):
        return matrix_engine.silu_and_mul(x, self.packed) if self._prefill(x) else None

    def dequantize(self):
        return self.module.dequantize(self.packed)


def dense_bf16_kernel(weight: torch.Tensor) -> DenseBf16Kernel | None:
    """The native kernel for a CPU bfloat16 weight [N, K], or None (another dtype or device,
    or no native library here: the caller keeps its oneDNN / F.linear path)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    mod = native()
    return DenseBf16Kernel(mod, mod.pack_bf16(weight.contiguous())) if mod is not None else None


class TorchInt8(Kernel):
    """aten._weight_int8pack_mm: per-output-channel int8, scales in the activation dtype."""

    name = "torch-int8"

    def __init__(self, qweight, scales) -> None:
        self.qweight, self.scales = qweight.contiguous(), scales[:, 0].contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x):
        s = self._by_dtype.get(x.dtype)
        if s is None:
            s = self._by_dtype[x.dtype] = self.scales.to(x.dtype)
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, s)

    def dequantize(self):  # the fp32 values (in bf16 the op rounds the scales first)
        return dequantize_int8(self.qweight, self.scales[:, None])


class TorchInt4(Kernel):
    """aten._weight_int4pack_mm_for_cpu: group-wise int4 with w = (q - 8) * scale + zero,
    our canonical formula; scales and zeros travel as [K/G, N, 2] in the activation dtype."""

    name = "torch-int4"

    def __init__(self, qweight, scales, zeros) -> None:
        self.canonical = (qweight, scales, zeros)
        q = unpack_nibbles(qweight).to(torch.int32)
        self.group = q.shape[1] // scales.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.stack([scales.float().T, zeros.float().T], dim=-1).contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x):
        sz = self._by_dtype.get(x.dtype)
        if sz is None:
            sz = self._by_dtype[x.dtype] = self.scales_zeros.to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, sz)

    def dequantize(self):  # the fp32 values (in bf16 the op rounds scales and zeros first)
        return dequantize_int4(*self.canonical)


def _torch_ok(kernel: Kernel, k: int, dequantized: torch.Tensor) -> bool:
    """Probe the op on this torch/CPU once: it runs and agrees with dequantize-then-matmul."""
    try:
        x = torch.randn(3, k)
        got = kernel(x)
        want = x @ dequantized.T
        return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item()))
    except (RuntimeError, NotImplementedError) as e:
        logger.debug("%s unavailable here: %s", kernel.name, e)
        return False


def _native_kernel(kind: str, *tensors, group: int) -> NativeKernel | None:
    mod = native()
    if mod is None:
        return None
    pack, fn = ((mod.pack_int8, mod.int8_linear) if kind == qf.INT8
                else (mod.pack_int4, mod.int4_linear))
    try:
        packed = pack(*(t.contiguous() for t in tensors), group)
    except ValueError as e:  # a group size it does not take (int4: 32/64/128)
        logger.info("native %s kernel does not take this weight (%s)", kind, e)
        return None
    return NativeKernel(f"native-{kind}", mod, fn, packed)


def _triton(kind: str, tensors):
    from quire.layers import triton_quant
    return triton_quant.kernel(kind, *tensors)


def int8_kernel(qweight: torch.Tensor, scales: torch.Tensor, exact: bool = True,
                prefer: str = "auto") -> Kernel:
    group = qweight.shape[1] // scales.shape[1]
    if prefer in ("auto", "native") and qweight.device.type == "cpu":
        kernel = _native_kernel(qf.INT8, qweight, scales, group=group)
        if kernel is not None:
            return kernel
    if prefer == "triton" or (prefer == "auto" and qweight.is_cuda):
        return _triton("int8", (qweight, scales))
    if (prefer in ("auto", "torch") and not exact and scales.shape[1] == 1
            and qweight.device.type == "cpu"):
        kernel = TorchInt8(qweight, scales)
        if _torch_ok(kernel, qweight.shape[1], dequantize_int8(qweight, scales)):
            return kernel
    return DequantMatmul(dequantize_int8, qweight, scales)


def int4_kernel(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                exact: bool = True, prefer: str = "auto") -> Kernel:
    k = qweight.shape[1] * 2
    group = k // scales.shape[1]
    if prefer in ("auto", "native") and qweight.device.type == "cpu":
        kernel = _native_kernel(qf.INT4, qweight, scales, zeros, group=group)
        if kernel is not None:
            return kernel
    if prefer == "triton" or (prefer == "auto" and qweight.is_cuda):
        return _triton("int4", (qweight, scales, zeros))
    if (prefer in ("auto", "torch") and not exact and group in (32, 64, 128, 256)
            and qweight.device.type == "cpu"):
        kernel = TorchInt4(qweight, scales, zeros)
        if _torch_ok(kernel, k, dequantize_int4(qweight, scales, zeros)):
            return kernel
    return DequantMatmul(dequantize_int4, qweight, scales, zeros)
