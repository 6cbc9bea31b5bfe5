"""What the machine did during a benchmark: CPU time stolen by the hypervisor. On a shared
VM, steal slows everything down; a figure measured under heavy steal is not comparable."""

from __future__ import annotations


def _cpu_times() -> list[int]:
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return []


class StealMeter:
    """with StealMeter() as m: ...; then m.steal_percent (None where /proc/stat is absent)."""

    def __enter__(self) -> StealMeter:
        self._start = _cpu_times()
        self.steal_percent = None
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_times()
        if len(end) > 7 and len(self._start) > 7:
            delta = [b - a for a, b in zip(self._start, end)]
            total = sum(delta[:8])
            self.steal_percent = 100.0 * delta[7] / total if total else 0.0

    def __str__(self) -> str:
        return "steal n/a" if self.steal_percent is None else f"CPU steal {self.steal_percent:.0f}%"


INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                     "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, [f for f in INTERESTING_FLAGS if f in flags]


def load_average() -> str:
    try:
        import os
        return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def describe_machine(threads: int | None = None) -> str:
    """One paragraph for a benchmark's header: CPU, flags, the quota Quire sees, threads, load."""
    from quire.cpu_threads import detect_quota
    model, flags = cpu_model_and_flags()
    quota = detect_quota()
    t = f"{threads} threads" if threads is not None else "threads: Quire's default"
    return (f"machine: {model}; flags {' '.join(flags) or 'none of note'}; {quota.describe()} "
            f"(quota {quota.cpus} cpus); {t}; {load_average()}")


def machine_caption(threads: int | None = None) -> str:
    """One short line for a plot: CPU, its flags of note, threads, the date."""
    import datetime
    model, flags = cpu_model_and_flags()
    t = f", {threads} threads" if threads else ""
    return f"{model} ({' '.join(flags) or 'no AVX'}){t}, {datetime.date.today()}"


def fma_peak_gflops(threads: int, march: str = "native") -> float | None:
    """The CPU's float32 FMA peak on `threads` threads (fma_peak.cpp, best of 3), or None
    where the native build is unavailable: the ceiling of any compute-bound float32 kernel."""
    import ctypes
    import os

    from quire.native.loader import load_library

    lib = load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.cpp"),
                       march)
    if lib is None:
        return None
    fn = lib.quire_fma_peak_gflops
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long]
    return max(fn(threads, 60_000_000) for _ in range(3))  # ~0.1 s each
