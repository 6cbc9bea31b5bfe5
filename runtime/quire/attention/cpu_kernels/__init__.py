"""Native CPU kernels: plain C++ compiled on first use with the system's C++ compiler (about a
second), cached under ~/.cache/quire/kernels (quire/writable_dirs.py says where), called
through ctypes.

`load_library("name.cpp")` builds and loads any C++ source in this folder the same way (one
cache entry per source, compiler and CPU); it returns None where there is no compiler, the
build failed, or QUIRE_CPU_KERNELS=0, and each caller keeps a torch path for that case.

Where there is no compiler the build fails once, a warning says so, and the torch backend
keeps its pure-torch path. QUIRE_CPU_KERNELS=0 turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from quire import writable_dirs

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(__file__)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

# Builds for named x86 vector ISAs, so tests can run each path a kernel has on a CPU that has
# newer ones: the compiler's flags, and the /proc/cpuinfo flags a CPU needs to run the result.
# Feature levels rather than CPU names: -march=cooperlake would also allow instructions that
# an AMD CPU with the same vector ISA lacks.
_V3 = ("sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm", "avx", "avx2",
       "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_BF16 = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
ISA_BUILDS = {
    "scalar": (["-march=x86-64"], ("sse2",)),
    "avx2": (["-march=x86-64-v3"], _V3),
    "avx512": (["-march=x86-64-v4"], _V4),
    "avx512_bf16": (_BF16, _V4 + ("avx512_bf16", "avx512_vnni")),
    "amx": (_BF16 + ["-mamx-tile", "-mamx-int8", "-mamx-bf16"],
            _V4 + ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16")),
}


def isa_builds() -> list[str]:
    """The names of ISA_BUILDS this CPU can run, oldest first (none off x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    flags = set(line.partition(":")[2].split())
    return [name for name, (_, needs) in ISA_BUILDS.items() if flags.issuperset(needs)]


def _cache_dir() -> str:
    """The cache's kernels folder, or a temporary one of this process's (quire/writable_dirs.py:
    QUIRE_CACHE_DIR, XDG_CACHE_HOME, HOME; QUIRE_CACHE_DIR="" turns the cache off)."""
    return writable_dirs.kernel_cache_dir()


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform
        return platform.machine() + platform.processor()


def _build(compiler: str, source_path: str, flags: list[str], rebuild: bool = False) -> str:
    with open(source_path, "rb") as f:
        source = f.read()
    for header in sorted(glob.glob(os.path.join(os.path.dirname(source_path), "*.h"))):
        with open(header, "rb") as f:  # what the sources include: a changed header rebuilds
            source += f.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native code is only good on this CPU: a cache shared by nodes keys on it too
    key = hashlib.sha256(source + " ".join(flags).encode() + version.encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source_path))[0]
    target = os.path.join(_cache_dir(), f"{stem}-{key}.so")
    if rebuild and os.path.exists(target):
        os.unlink(target)
    if not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, source_path, "-o", tmp], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, target)  # atomic: concurrent builders are harmless
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def load_library(source: str, march: str = "native") -> ctypes.CDLL | None:
    """The compiled library of `source` (a .cpp file in this folder), or None (see above).
    `march` other than "native" builds for an older CPU: a name in ISA_BUILDS ("avx2": no
    AVX-512) or any -march value, so tests can run a kernel's other paths on a machine that
    has newer ones."""
    if os.environ.get("QUIRE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found; %s is not built and its torch path is used", source)
        return None
    try:
        arch = ISA_BUILDS[march][0] if march in ISA_BUILDS else [f"-march={march}"]
        flags = [g for f in _FLAGS for g in (arch if f == "-march=native" else [f])]
        source_path = os.path.join(_HERE, source)
        path = _build(compiler, source_path, flags)
        try:
            return ctypes.CDLL(path)
        except OSError as e:  # a cached build cut short or damaged: build it again, once
            logger.warning("the cached build %s does not load (%s); building it again", path, e)
            return ctypes.CDLL(_build(compiler, source_path, flags, rebuild=True))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("the native CPU kernels in %s could not be built; using the torch path: %s",
                       source, detail.strip().splitlines()[-1:] or detail)
        return None


@functools.cache
def _library(march: str = "native"):
    lib = load_library("paged_decode.cpp", march)
    if lib is None:
        return None
    fn = lib.quire_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p]
    return fn


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in _DTYPE_CODES and k_cache.dtype == q.dtype
            and _library() is not None)


def sinks_arg(sinks: torch.Tensor | None, num_heads: int) -> tuple[torch.Tensor | None, int]:
    """(the float32 contiguous tensor to keep alive during the call, its address or 0)."""
    if sinks is None:
        return None, 0
    sinks = sinks.to(torch.float32).contiguous()
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
    return sinks, sinks.data_ptr()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, window: int | None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, _march: str = "native") -> None:
    """out[i] = attention of q[i] (one token) over the first seq_lens[i] tokens of sequence i,
    read through block_tables[i], with soft-capping and sinks where given (base.py).
    q/out [n, H, D] with contiguous rows; caches [num_blocks, block_size, Hkv, D] contiguous;
    block_tables/seq_lens int32; sinks [H]. `_march` (tests) runs a build for an older CPU:
    "haswell" the AVX2 path, "x86-64" the plain C++ one."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    seq_lens = seq_lens.contiguous()
    sinks, sinks_ptr = sinks_arg(sinks, num_heads)
    rc = _library(_march)(_DTYPE_CODES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    out.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), n, num_heads,
                    num_kv_heads, head_dim, block_size, q.stride(0), out.stride(0),
                    block_tables.stride(0), scale, window or 0, softcap or 0.0, sinks_ptr)
    if rc:
        raise RuntimeError(f"paged_decode: unsupported dtype {q.dtype}")
