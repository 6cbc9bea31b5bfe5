"""Prefill of quantized weights on the CPU's matrix engine: AMX tiles, the library's own or
oneDNN's.

The native kernels (quant_matmul.cpp) multiply on the vector units: at a prefill's rows they
run near the vector FMA peak (benchmarks/prefill_roofline.py), and that peak is what a CPU
with AMX leaves on the table: issue 48 measured torch's bfloat16 GEMM (oneDNN on AMX) at
~2,100 GFLOP/s on a 2-core Xeon against ~140 for Quire's quantized prefill. So a call with
many rows of bfloat16 x (a prefill chunk, a large batch) dequantizes its weight to bfloat16
and multiplies by that, the dequantize-to-bfloat16 road (IPEX's and vLLM's CPU path), taken
rather than int8 AMX because it keeps float activations (int8 activations cost agreement with
transformers: benchmarks/quant_parity.py --activation-quantization int8; an opt-in,
native/int8_activations.h). Where the library has AMX tiles
(`quant_matmul.dequantized_linear`) each pair of row blocks is dequantized in cache and
multiplied there, whole rows of K summed in the tiles: a SmolLM2 step's matmuls at 512 rows
in 126 ms against 268 through a bfloat16 copy and oneDNN and 284 on the native kernel's
per-group tiles (2-core AMX Xeon). Elsewhere the weight is dequantized once a call
(`quant_matmul.dequantize_bf16`, into a scratch the size of the largest layer, reused) and
torch's F.linear (oneDNN) multiplies.

When (`wants`): x is bfloat16 (the model runs in bfloat16: what `--dtype auto` picks on such
a CPU), 2-D with at least MIN_ROWS rows, and the engine is on. $QUIRE_MATRIX_ENGINE:
- `auto` (default): on where the CPU has amx_bf16 and torch's oneDNN does bfloat16 here: at
  once where the library's own tiles run (`quant_matmul.amx_ready`: 1.6x the native kernel
  at 64 rows, 2.2x at 512), else only if, on the first such call, oneDNN's road measures
  faster than the native kernel on that call's input (each timed twice; the answer holds for
  the process and is logged). (The library's tiles were measured too, at first: a 71-row
  call of ~0.2 ms either way chose the native kernel in 1 start of 4, a server's prefill then
  ~1.6x slower for its life.)
- `1`: on for every such call on any CPU (tests and benchmarks; slow without AMX);
- `0`: off.

What it costs: the weight is rounded to bfloat16 (the native kernel multiplies its exact
value), so a row of y differs from the native kernel's by about one bfloat16 rounding of each
product, bounded in tests/runtime/test_matrix_engine.py; and a row's bits then depend on
whether its step had MIN_ROWS rows: batch invariance holds within each path, not across the
two. Decode and verification steps (fewer rows) keep the native kernel unchanged, so the
greedy decode of a float32 model, and of any model on a CPU without AMX, is what it was.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

from quire import platform
from quire.native import fused_ops, quant_matmul

logger = logging.getLogger(__name__)

MIN_ROWS = 64  # fewer rows than this keep the native kernel (decode, verification, beams)
_MODES = ("auto", "0", "1")

_local = threading.local()     # each thread's bfloat16 weight scratch
_decision: bool | None = None  # `auto`'s measured answer, once made
calls = 0                      # calls taken here (tests, benchmarks)


def mode() -> str:
    value = os.environ.get("QUIRE_MATRIX_ENGINE", "auto")
    if value not in _MODES:
        raise ValueError(f"QUIRE_MATRIX_ENGINE must be one of {', '.join(_MODES)}, got {value!r}")
    return value


def available() -> bool:
    """The CPU has an AMX bfloat16 unit and torch's oneDNN multiplies bfloat16 here."""
    return "amx_bf16" in platform.cpu_flags() and onednn_bf16()


@functools.cache
def onednn_bf16() -> bool:
    """torch's oneDNN has bfloat16 GEMM kernels on this CPU (AMX or AVX512-BF16)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def wants(x: torch.Tensor, packed, native_fn) -> bool:
    """Whether this call goes to the matrix engine (see above); `native_fn(x, packed)` is the
    native kernel `auto` measures against on its first call."""
    if x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[0] < MIN_ROWS:
        return False
    if packed.int8_activations:  # rounded x takes the native kernel at every M (one order)
        return False
    m = mode()
    if m != "auto":
        return m == "1"
    global _decision
    if _decision is None:
        tiles = quant_matmul.amx_ready()
        _decision = available() and (tiles or _measure(x, packed, native_fn))
        if _decision and tiles:
            logger.info("quantized prefill (%d+ rows) on the library's AMX tiles over "
                        "dequantized weights", MIN_ROWS)
    return _decision


def linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [M, K] bfloat16 @ dequantize(packed).T in bfloat16, by torch's (oneDNN's) GEMM."""
    global calls
    calls += 1
    y = quant_matmul.dequantized_linear(x, packed)  # the library's own tiles, where it has them
    if y is not None:
        return y
    size = packed.n * packed.k
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < size:
        scratch = _local.scratch = torch.empty(size, dtype=torch.bfloat16)
    weight = quant_matmul.dequantize_bf16(packed, scratch[:size].view(packed.n, packed.k))
    return F.linear(x, weight)


def silu_and_mul(x: torch.Tensor, packed) -> torch.Tensor | None:
    """fused_ops.silu_and_mul(linear(x, packed)) for a gated MLP's gate|up weight, bit for
    bit, in one pass on the library's tiles (the product never goes to memory: at 512 rows
    it is 3 MB written and read again, the separate pass ~10% of a SmolLM2 prefill); None
    where they or torch's exp are not here (the caller then takes the two steps)."""
    global calls
    silu = fused_ops.bf16_silu_exp(packed.n // 2)
    y = None if silu is None else quant_matmul.dequantized_linear(x, packed, silu=silu)
    calls += y is not None
    return y


def _measure(x, packed, native_fn) -> bool:
    def best(fn) -> float:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn(x, packed)
            times.append(time.perf_counter() - start)
        return min(times)

    try:
        engine, native = best(linear), best(native_fn)
    except RuntimeError as e:  # an op this torch build lacks here
        logger.warning("the matrix engine path failed (%s); quantized prefill stays native", e)
        return False
    faster = engine < native
    logger.info("quantized prefill (%d rows, %dx%d weight): matrix engine %.2f ms, native "
                "kernel %.2f ms: %s", x.shape[0], packed.n, packed.k, engine * 1e3, native * 1e3,
                "using the matrix engine" if faster else "keeping the native kernel")
    return faster
