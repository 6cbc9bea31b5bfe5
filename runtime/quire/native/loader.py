"""Builds and loads the native CPU kernels: plain C++ compiled on first use with the system's
C++ compiler (seconds; ~20-30 s for the two largest on a 2-core EPYC), cached under
~/.cache/quire/kernels (quire/writable_dirs.py says where), called through ctypes.

`load_library("name.cpp")` builds and loads a C++ source of this folder, or of another
folder given by its path, the same way ($QUIRE_CPU_ISA=avx2, say, builds every kernel for one
of ISA_BUILDS instead of -march=native: benchmarks compare the builds): one cache
entry per source, compiler and CPU. Every source may include the shared headers of this folder
(bf16.h). It returns None where there is no compiler, the build failed, or
QUIRE_CPU_KERNELS=0, and each caller keeps a torch path for that case: where there is no
compiler the build fails once, a warning says so, and the torch path runs.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

from quire import writable_dirs

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(__file__)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]

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
    "amx": (_BF16 + ["-mavx512vbmi", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
            _V4 + ("avx512_bf16", "avx512_vnni", "avx512vbmi", "amx_tile", "amx_int8",
                   "amx_bf16")),
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
    folders = sorted({os.path.dirname(source_path), _HERE})
    for header in sorted(h for d in folders for h in glob.glob(os.path.join(d, "*.h"))):
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
        # one builder per target: the others (test workers, a node's pods on a shared cache)
        # wait for its result instead of compiling the same ~20 s source again beside it
        with open(target + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(target):  # not built while this process waited
                _compile(compiler, flags, source_path, target)
    return target


def _compile(compiler: str, flags: list[str], source_path: str, target: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        # the include path stays out of the key: a cache shared by nodes may install Quire
        # elsewhere
        subprocess.run([compiler, *flags, f"-I{_HERE}", source_path, "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: a reader never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _forced_isa(name: str) -> str:
    """$QUIRE_CPU_ISA: every kernel built for one ISA of ISA_BUILDS this CPU runs instead of
    -march=native (benchmarks compare the builds), else a ValueError saying which it runs."""
    runnable = isa_builds()
    if name not in runnable:
        raise ValueError(f"QUIRE_CPU_ISA={name!r}: this CPU runs the builds "
                         f"{', '.join(runnable) or 'none'}")
    return name


@functools.cache
def load_library(source: str, march: str = "native") -> ctypes.CDLL | None:
    """The compiled library of `source` (a .cpp file in this folder, or a path to one
    elsewhere), or None (see above).
    `march` other than "native" builds for an older CPU: a name in ISA_BUILDS ("avx2": no
    AVX-512) or any -march value, so tests can run a kernel's other paths on a machine that
    has newer ones."""
    if os.environ.get("QUIRE_CPU_KERNELS", "1") == "0":
        return None
    if march == "native" and os.environ.get("QUIRE_CPU_ISA"):
        march = _forced_isa(os.environ["QUIRE_CPU_ISA"])
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found; %s is not built and its torch path is used", source)
        return None
    try:
        arch = ISA_BUILDS[march][0] if march in ISA_BUILDS else [f"-march={march}"]
        flags = [g for f in _FLAGS for g in (arch if f == "-march=native" else [f])]
        source_path = os.path.join(_HERE, source)  # an absolute `source` stays as it is
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
