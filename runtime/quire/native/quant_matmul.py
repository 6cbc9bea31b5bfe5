"""Weight-only int8 / int4 linear layers on the CPU: the native kernels of quant_matmul.cpp.

The canonical formats a loader or quantizer hands in:
- int8: `qweight` int8 [N, K], `scales` float32 [N, K // G]; w[n, k] = q * scales[n, k // G]
  (G = K: one scale per output channel; G = 32: GGUF Q8_0).
- int4: `qweight` uint8 [N, K // 2], low nibble = even k; `scales` / `zeros` float32
  [N, K // G], G in 32 / 64 / 128; w = (q - 8) * scale + zero (GGUF Q4_0: zero = 0;
  Q4_1: scale = d, zero = m + 8 d).

`pack_*` reorders them once into the kernel's layout (blocks of 16 output rows, interleaved
so one vector load holds one k of all 16) and picks the cheapest exact form: no offset when
every zero is 0, w = q d + m where m = zero - 8 d is exact (Q4_1's own m), and float16
scales / offsets where every value is one (GGUF's always are: no more bytes than the file).
`*_linear(x, packed)` is `(x.float() @ dequantize(packed).T).to(x.dtype)` with float32 sums;
only where float32 rounds differs (tests/runtime/test_quant_matmul.py states the bound).
`available()` says whether the native library runs here; without it the same calls take a
torch path (dequantize, then matmul): slower, same semantics.

One kernel serves every M, and a row of y has the same bits whatever rows come with it
(batch invariance, on every build): each row sums each group's x * q' in one chain, in order,
then adds the group's scale times it (and its offset times the group's sum of x). At M = 1
it reads weights faster than torch's own int4 and int8 kernels (the 2-core AVX-512 EPYC, one
thread, benchmarks/quant_matmul.py). Beyond 5 rows of x (AVX2; 8 with AVX-512) it expands
each 16-row block's integers once into a per-thread scratch that every tile of x rows reuses
(for bfloat16 x as exact bfloat16 integers, for the AVX512-BF16 dot product). Before the
expanded tiles took the group order (they multiplied dequantized weights), on the AVX-512
EPYC at M = 32 and 512, int4 and int8 with bfloat16 x ran within 0.8-1x of dense bfloat16
F.linear, with float32 x ahead of float32 F.linear; on the AVX2-only EPYC (float32
activations: its bfloat16 is emulated) the 6-row tiles ran ahead of float32 F.linear at every
M from 32 to 1024 (2026-11-26: 28.6 against 30.7 ms for one SmolLM2 layer's four matmuls at
M = 512, 4.0 against 5.8 at M = 64), so no M goes to a dequantized copy and a matmul library.
The per-group scale and offset now cost the float32 tiles some of that margin.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from quire.native import huge_pages, loader

ROWS = 16  # output rows per block: quant_matmul.cpp's kRows
INT4_GROUPS = (32, 64, 128)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    lib = loader.load_library("quant_matmul.cpp", march)
    if lib is None:
        return None
    lib.quire_quant_linear.restype = ctypes.c_int
    lib.quire_quant_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.quire_quant_linear_packed.restype = ctypes.c_int
    lib.quire_quant_linear_packed.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p]
    lib.quire_quant_linear_dequantized.restype = ctypes.c_int
    lib.quire_quant_linear_dequantized.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64]
    lib.quire_dequantize_bf16.restype = ctypes.c_int
    lib.quire_dequantize_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.quire_q8_applies.restype = ctypes.c_int
    lib.quire_q8_applies.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.quire_quant_matmul_isa.restype = ctypes.c_char_p
    lib.quire_quant_matmul_amx_ready.restype = ctypes.c_int
    lib.quire_quant_matmul_set_amx_min_rows.restype = ctypes.c_int
    lib.quire_quant_matmul_set_amx_min_rows.argtypes = [ctypes.c_int]
    lib.quire_quant_matmul_set_amx_min_rows(amx_min_rows())
    lib.quire_stream_read.restype = ctypes.c_uint64
    lib.quire_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """The native library is built and runs on this CPU."""
    return _library() is not None


def isa(march: str = "native") -> str | None:
    """The vector path the library was built with ("amx": AVX512-BF16 plus AMX tiles for
    bfloat16 x, "avx512-bf16": AVX-512 plus the bfloat16 dot product for bfloat16 x,
    "avx512", "avx2", "scalar"), or None. `march`: "native" or a build of loader.ISA_BUILDS
    (tests)."""
    lib = _library(march)
    return lib.quire_quant_matmul_isa().decode() if lib is not None else None


# An "amx" build multiplies bfloat16 x on the tile unit in calls of AMX_MIN_ROWS rows or more
# (quant_matmul.cpp's kAmxMinRows; $QUIRE_AMX_MIN_ROWS changes it), where the groups are whole
# tiles (AMX_GROUP_MULTIPLE k); fewer rows keep the AVX512-BF16 dot product, faster for one or
# two rows. The two sum a group in different orders, so QUIRE_AMX_MIN_ROWS=1 is the choice
# for bfloat16 outputs that never depend on the rows beside them (speculative decoding's
# verification rows then have exactly the bits of decode rows). A float model's bfloat16
# weights (pack_bf16) take the tiles from one row whatever it says: with no fold their one
# row costs what the FMAs cost, and their rows then have the prefill tiles' bits at every M.
AMX_MIN_ROWS, AMX_GROUP_MULTIPLE = 3, 32


def amx_min_rows() -> int:
    """$QUIRE_AMX_MIN_ROWS, checked (an integer >= 1), else AMX_MIN_ROWS."""
    value = os.environ.get("QUIRE_AMX_MIN_ROWS", str(AMX_MIN_ROWS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"QUIRE_AMX_MIN_ROWS must be an integer >= 1 (rows of x from which "
                         f"bfloat16 calls use the AMX tiles), got {value!r}")
    return int(value)


def _set_amx_min_rows(rows: int, march: str = "native") -> int:
    """The library's threshold set to `rows` (tests; 0 leaves it); returns the one in force
    (0 for a build without the tiles)."""
    return _library(march).quire_quant_matmul_set_amx_min_rows(rows)


def _amx_min_rows_in_force(march: str = "native") -> int:
    return _set_amx_min_rows(0, march)


def amx_ready(march: str = "native") -> bool:
    """This build multiplies on the AMX tiles here (the kernel granted the process their
    state; without it bfloat16 x keeps the dot product for every M)."""
    lib = _library(march)
    return lib is not None and lib.quire_quant_matmul_amx_ready() == 1


def amx_rows_differ(march: str, x_dtype, packed) -> bool:
    """Whether a row's bits depend on its call having AMX_MIN_ROWS rows or more (tests)."""
    return (amx_ready(march) and x_dtype == torch.bfloat16 and packed.form != BF16
            and packed.group % AMX_GROUP_MULTIPLE == 0 and _amx_min_rows_in_force(march) > 1)


# The weight forms of quant_matmul.cpp; pack_int4 picks the one that gives the canonical
# values exactly with the least work and the fewest bytes.
INT8, INT4_SYMMETRIC, INT4_ZERO, INT4_MIN, BF16 = 0, 1, 2, 3, 4


class _PackedArgs(ctypes.Structure):  # quant_matmul.cpp's PackedArgs
    _fields_ = [("form", ctypes.c_int32), ("half", ctypes.c_int32), ("q", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group", ctypes.c_int64),
                ("activations", ctypes.c_int32)]


class PackedWeight:
    """A weight in the kernel's layout, with its ctypes arguments made once into one struct
    (a decode step calls the kernel a few hundred times; each call passes x, y and its
    address).

    form: INT8 (w = q s), INT4_SYMMETRIC (w = (q - 8) s), INT4_ZERO (w = (q - 8) s + z) or
    INT4_MIN (w = q s + m); `offsets` holds z or m; scales and offsets are float16 where
    every value is exactly one, else float32."""

    __slots__ = ("form", "bits", "n", "k", "group", "qweight", "scales", "offsets", "_struct",
                 "_address", "_fn", "_q8_applies")

    def __init__(self, form, n, k, group, qweight, scales, offsets, march="native"):
        self.form, self.n, self.k, self.group = form, n, k, group
        self.bits = {INT8: 8, BF16: 16}.get(form, 4)
        self._struct = _PackedArgs(form, scales.dtype == torch.float16, 0, 0, None, n, k, group)
        self._address = ctypes.addressof(self._struct)  # what each call passes
        self._hold(qweight, scales, offsets)
        lib = _library(march)
        self._fn = lib.quire_quant_linear_packed if lib is not None else None
        self._q8_applies = lib.quire_q8_applies if lib is not None else None

    def _hold(self, qweight, scales, offsets) -> None:
        """Keep these tensors (the same values, perhaps moved: move_to_huge_pages) and point
        the struct every call passes, so everything that holds its address, at them."""
        self.qweight, self.scales, self.offsets = qweight, scales, offsets
        self._struct.q, self._struct.scales = qweight.data_ptr(), scales.data_ptr()
        self._struct.offsets = offsets.data_ptr() if offsets is not None else None

    @property
    def int8_activations(self) -> bool:
        """Whether calls round x to int8 per 32 values (native/int8_activations.h)."""
        return bool(self._struct.activations)

    def use_int8_activations(self, on: bool = True) -> bool:
        """Rounds x to int8 per 32 values of k in every call from now on, where the weight
        takes it (int4 forms, and int8 on builds with AVX512-VNNI; groups of whole 32-k
        blocks) and the library is there (the torch path keeps float x). Returns whether it
        does."""
        self._struct.activations = int(on and self._q8_applies is not None
                                       and self._q8_applies(self.form, self.k, self.group) == 1)
        return self.int8_activations

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.offsets) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __repr__(self) -> str:
        return (f"PackedWeight(form={self.form}, n={self.n}, k={self.k}, group={self.group}, "
                f"scales {self.scales.dtype})")


def packed_weights(model: torch.nn.Module) -> list[PackedWeight]:
    """The model's native packed weights (each layer's quant_kernel or native_kernel's, and
    an MoE layer's per-expert kernels'), each once."""
    found: dict[int, PackedWeight] = {}
    for module in model.modules():
        kernels = [getattr(module, name, None) for name in ("quant_kernel", "native_kernel")]
        experts = getattr(module, "expert_kernels", None)  # {proj: [one per expert]}
        if isinstance(experts, dict):
            kernels += [k for per_expert in experts.values() for k in per_expert]
        for kernel in kernels:
            packed = getattr(kernel, "packed", None)
            if isinstance(packed, PackedWeight):
                found.setdefault(id(packed), packed)
    return list(found.values())


def move_to_huge_pages(packs: list[PackedWeight]) -> int:
    """Moves the packed weights into one huge-page mapping (native/huge_pages.py: a decode
    step streams them all), each original dropped as its copy is made. Returns the bytes
    moved: 0 where huge pages are not available."""
    arena = huge_pages.arena(huge_pages.footprint([t for p in packs for t in p.tensors()]))
    if arena is None:
        return 0
    moved = 0
    for p in packs:
        p._hold(*(None if t is None else arena.copy(t)
                  for t in (p.qweight, p.scales, p.offsets)))
        moved += p.nbytes()
    return moved


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _row_blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16]: padded with zero rows, one k of 16 rows contiguous."""
    n, c = t.shape
    padded = torch.zeros((n + ROWS - 1) // ROWS * ROWS, c, dtype=t.dtype)
    padded[:n] = t
    return padded.view(-1, ROWS, c).transpose(1, 2).contiguous()


def _exact_in(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every value of t (float64 or float32) is exactly a `dtype` value."""
    return bool((t.to(dtype).to(t.dtype) == t).all())


def _compact(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float16 copies where every value is exactly a float16 (GGUF's d and m are), else
    float32: the kernel reads them per group, half the bytes for the same values."""
    dtype = torch.float16 if all(_exact_in(t, torch.float16) for t in tensors) else torch.float32
    return tuple(_row_blocks(t.to(dtype)) for t in tensors)


def _check_group(k: int, group: int, allowed: tuple[int, ...] | None) -> None:
    if allowed is not None and group not in allowed:
        raise ValueError(f"group must be one of {allowed}, got {group}")
    if not isinstance(group, int) or group <= 0 or k % group:
        raise ValueError(f"group must be a positive divisor of K={k}, got {group}")


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor, group: int,
              _march: str = "native") -> PackedWeight:
    """int8 `qweight` [N, K] and float32 `scales` [N, K // group] -> the kernel's layout."""
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("qweight must be a 2-D int8 tensor [N, K]")
    n, k = qweight.shape
    _check_group(k, group, None)
    _check("qweight", qweight, torch.int8, (n, k))
    _check("scales", scales, torch.float32, (n, k // group))
    (blocked_scales,) = _compact(scales)
    return PackedWeight(INT8, n, k, group, _row_blocks(qweight), blocked_scales, None, _march)


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
              _march: str = "native") -> PackedWeight:
    """uint8 `qweight` [N, K // 2] (two nibbles a byte, low = even k) with float32 `scales`
    and `zeros` [N, K // group] -> the kernel's layout."""
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("qweight must be a 2-D uint8 tensor [N, K // 2]")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    _check_group(k, group, INT4_GROUPS)
    _check("qweight", qweight, torch.uint8, (n, k // 2))
    _check("scales", scales, torch.float32, (n, k // group))
    _check("zeros", zeros, torch.float32, (n, k // group))
    signed = _row_blocks(qweight ^ 0x88)  # each nibble, read as signed 4 bits, is q - 8
    if not zeros.any():  # Q4_0, symmetric int4: no offset to read at all
        return PackedWeight(INT4_SYMMETRIC, n, k, group, signed, *_compact(scales), None,
                            _march)
    # w = (q - 8) s + z = q s + m with m = z - 8 s (Q4_1's own m): one op less per weight,
    # taken where m is exact, so both forms are the same real number
    mins = zeros.double() - 8 * scales.double()
    half = torch.float16
    if _exact_in(scales, half) and _exact_in(mins, half):
        return PackedWeight(INT4_MIN, n, k, group, _row_blocks(qweight),
                            *_compact(scales, mins.float()), _march)
    if (_exact_in(scales, half) and _exact_in(zeros, half)) or not _exact_in(mins, torch.float32):
        return PackedWeight(INT4_ZERO, n, k, group, signed, *_compact(scales, zeros), _march)
    return PackedWeight(INT4_MIN, n, k, group, _row_blocks(qweight),
                        *_compact(scales, mins.float()), _march)


def pack_bf16(weight: torch.Tensor, _march: str = "native") -> PackedWeight:
    """A bfloat16 float weight [N, K] -> the kernel's layout (form BF16: one group of K, scale
    1, so each row is one float32 chain over k, as for the quantized forms): a float model's
    decode rows at one weight read (layers/quantization.py's FloatLinearMethod)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D bfloat16 tensor [N, K]")
    n, k = weight.shape
    _check("weight", weight, torch.bfloat16, (n, k))
    ones = _row_blocks(torch.ones(n, 1, dtype=torch.float16))
    return PackedWeight(BF16, n, k, k, _row_blocks(weight.contiguous().view(torch.int16)), ones,
                        None, _march)


def _unblock(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the kernel multiplies by (the torch path and tests use it)."""
    q = _unblock(packed.qweight, packed.n)
    if packed.form == BF16:
        return q.view(torch.bfloat16).float()
    scales = _unblock(packed.scales, packed.n).float().repeat_interleave(packed.group, dim=1)
    if packed.form == INT8:
        return q.float() * scales
    if packed.form != INT4_MIN:
        q = q ^ 0x88
    nibbles = torch.stack([q & 15, q >> 4], dim=-1).reshape(packed.n, packed.k).float()
    if packed.form == INT4_SYMMETRIC:
        return (nibbles - 8) * scales
    offsets = _unblock(packed.offsets, packed.n).float().repeat_interleave(packed.group, dim=1)
    if packed.form == INT4_ZERO:
        return torch.addcmul(offsets, nibbles - 8, scales)
    return torch.addcmul(offsets, nibbles, scales)


def dequantize_bf16(packed: PackedWeight, out: torch.Tensor | None = None,
                    march: str = "native") -> torch.Tensor:
    """dequantize(packed) rounded to bfloat16 [N, K] (into `out` when given), by the native
    library where it runs: what a matrix engine's GEMM takes (matrix_engine.py)."""
    if out is None:
        out = torch.empty(packed.n, packed.k, dtype=torch.bfloat16)
    lib = _library(march)
    if lib is None or packed._fn is None:
        return out.copy_(dequantize(packed))
    lib.quire_dequantize_bf16(packed._address, out.data_ptr(), torch.get_num_threads())
    return out


def dequantized_linear(x: torch.Tensor, packed: PackedWeight, march: str = "native",
                       silu: tuple[int, int] | None = None) -> torch.Tensor | None:
    """x @ dequantize_bf16(packed).T for bfloat16 x [M, K], float32 sums, on the AMX tiles
    without a bfloat16 copy of the weight (each pair of row blocks is dequantized in cache);
    None where the library cannot (no AMX build or permission, an unsupported weight): the
    caller then dequantizes and calls torch. matrix_engine.py's prefill road.
    `silu` = (fused_ops.bf16_silu_exp(N / 2)) for a gated MLP's gate|up weight: then
    fused_ops.silu_and_mul of that product, [M, N / 2], bit for bit, in the tiles' epilogue
    (the product never stored)."""
    lib = _library(march)
    if lib is None or x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[1] != packed.k:
        return None
    x = x.contiguous()
    exp16, vec_end = silu or (None, 0)
    y = torch.empty((x.shape[0], packed.n // 2 if silu else packed.n), dtype=torch.bfloat16)
    if lib.quire_quant_linear_dequantized(x.data_ptr(), y.data_ptr(), x.shape[0],
                                          torch.get_num_threads(), packed._address, exp16,
                                          vec_end):
        return None
    return y


def _linear(x: torch.Tensor, packed: PackedWeight, bits: int) -> torch.Tensor:
    # the common case first, in as few Python operations as possible: a decode step makes a
    # few hundred of these calls
    code = _DTYPE_CODES.get(x.dtype)
    fn = packed._fn
    if (fn is not None and code is not None and x.dim() == 2 and x.is_cpu
            and x.shape[1] == packed.k and packed.bits == bits):
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty((x.shape[0], packed.n), dtype=x.dtype)
        fn(x.data_ptr(), y.data_ptr(), x.shape[0], code, torch.get_num_threads(), packed._address)
        return y
    if packed.bits != bits:
        raise ValueError(f"packed must come from pack_int{bits}, got an int{packed.bits} weight")
    if code is None or not x.is_cpu:
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on "
                         f"{x.device.type}")
    if x.dim() != 2:
        if x.dim() == 0 or x.shape[-1] != packed.k:
            raise ValueError(f"x must have shape [..., {packed.k}], got {list(x.shape)}")
        return _linear(x.reshape(-1, packed.k), packed, bits).view(*x.shape[:-1], packed.n)
    if x.shape[1] != packed.k:
        raise ValueError(f"x must have shape [M, {packed.k}], got {list(x.shape)}")
    return (x.float() @ dequantize(packed).T).to(x.dtype)  # no library: the torch path


def int8_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W^T for a pack_int8 weight -> [M, N], x's dtype."""
    return _linear(x, packed, 8)


def bf16_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W^T for a pack_bf16 weight -> [M, N], x's dtype."""
    return _linear(x, packed, 16)


def int4_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ W^T for a pack_int4 weight -> [M, N], x's dtype."""
    return _linear(x, packed, 4)
