"""How many CPU threads torch gets: the CPU quota this process really has, not the host's cores.

In a container, `os.cpu_count()` (and torch's default) is the host's core count, while the
cgroup lets the process run for only `quota / period` CPU-seconds per second. More compute
threads than that get throttled in turn and wait on each other at every barrier, which is far
slower than fewer threads. So the default is the smallest of: the cgroup v2 `cpu.max` (or v1
`cpu.cfs_quota_us / cpu.cfs_period_us`) of this cgroup and every ancestor, rounded up; and the
CPUs in `sched_getaffinity` (taskset, cpusets). `--num-threads` (or QUIRE_NUM_THREADS) wins.

The HTTP event loop and the engine step already run in different threads (AsyncEngine's one
worker thread steps the engine; the event loop only does I/O and hands work to it), so the
server needs no core of its own at small quotas: the event loop is idle while a step computes,
and giving it one of two cores would halve every step. From `SERVER_RESERVE_FROM` CPUs up, the
server leaves one CPU to the event loop and the tokenizer pool: a step's barrier waits for its
slowest thread, so one compute thread preempted by request handling stalls the whole step,
and one core of several costs the step little.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

logger = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
ENV_VAR = "QUIRE_NUM_THREADS"
SERVER_RESERVE_FROM = 4  # CPUs from which `quire serve` keeps one for the event loop


@dataclasses.dataclass(frozen=True)
class CpuQuota:
    """What limits this process's CPU use; None where a limit is absent."""
    cgroup: float | None = None    # CPUs the cgroup quota allows (quota / period)
    cgroup_source: str = ""        # "cpu.max" (v2) or "cpu.cfs_quota_us" (v1)
    affinity: int | None = None    # CPUs in the affinity mask

    @property
    def cpus(self) -> int:
        """Whole CPUs available: the smallest limit, the cgroup's rounded up, at least 1."""
        limits = [self.affinity or os.cpu_count() or 1]
        if self.cgroup is not None:
            limits.append(math.ceil(self.cgroup - 1e-9))  # 1.5 CPUs: two threads, not one
        return max(1, min(limits))

    def describe(self) -> str:
        cg = (f"cgroup {self.cgroup_source} {self.cgroup:g}" if self.cgroup is not None
              else "cgroup no CPU limit")
        aff = f"affinity {self.affinity} cpus" if self.affinity else "affinity unknown"
        return f"{cg}, {aff}"


def detect_quota(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup",
                 affinity: set[int] | None = None) -> CpuQuota:
    """This process's CPU limits (the paths and the affinity set are parameters for tests)."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not on Linux
            affinity = set()
    lines = _read_lines(proc_cgroup)
    v2 = _cgroup_v2(cgroup_root, lines)
    if v2 is not None:
        cgroup, source = v2, "cpu.max"
    else:
        cgroup, source = _cgroup_v1(cgroup_root, lines), "cpu.cfs_quota_us"
    return CpuQuota(cgroup, source if cgroup is not None else "", len(affinity) or None)


def resolve_threads(requested: int | None, quota: CpuQuota, serving: bool = False,
                    env: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, why): `requested` (--num-threads) first, then $QUIRE_NUM_THREADS, then the
    quota (minus one CPU for a server's event loop from SERVER_RESERVE_FROM CPUs up)."""
    env = os.environ if env is None else env
    if requested is not None:
        return requested, f"--num-threads {requested}"
    text = env.get(ENV_VAR, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_VAR} must be an integer >= 1; got {text!r}")
        return n, f"{ENV_VAR}={n}"
    n = quota.cpus
    if serving and n >= SERVER_RESERVE_FROM:
        return n - 1, "--num-threads unset, one CPU left to the HTTP event loop"
    return n, "--num-threads unset"


_interop_set = False


def configure_threads(requested: int | None, serving: bool = False,
                      quota: CpuQuota | None = None) -> int:
    """Size torch's intra-op pool from the quota, once per process size the inter-op pool,
    and log the choice. Returns the intra-op thread count."""
    import torch
    global _interop_set
    quota = detect_quota() if quota is None else quota
    threads, why = resolve_threads(requested, quota, serving)
    torch.set_num_threads(threads)
    if not _interop_set:
        _interop_set = True
        try:  # Quire forks no inter-op work: one thread, instead of one idle per core
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only allowed before any inter-op work; then keep torch's
            logger.debug("torch's inter-op pool already started; left as it is")
    logger.info("threads: %d (%s, %s)", threads, quota.describe(), why)
    if threads > quota.cpus:
        logger.warning("%d compute threads for %d CPUs (%s): they take turns at every barrier "
                       "of a step, which is slower than %d threads", threads, quota.cpus,
                       quota.describe(), quota.cpus)
    return threads


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_v2(root: str, proc_lines: list[str]) -> float | None:
    """The tightest cpu.max from this process's cgroup up to the root; None if unlimited or
    not cgroup v2. Inside a container's cgroup namespace the path is "/" and the mount is the
    container's own cgroup, so the walk starts at the mount when the path is not under it."""
    rel = next((ln[3:] for ln in proc_lines if ln.startswith("0::")), None)
    if rel is None and not os.path.exists(os.path.join(root, "cgroup.controllers")):
        return None
    here = os.path.join(root, (rel or "/").lstrip("/"))
    if not os.path.isdir(here):
        here = root
    best = None
    while True:
        text = _read(os.path.join(here, "cpu.max"))
        if text:
            parts = text.split()
            if parts[0] != "max":
                try:
                    period = float(parts[1]) if len(parts) > 1 else 100000.0
                    cpus = float(parts[0]) / period
                    best = cpus if best is None else min(best, cpus)
                except (ValueError, ZeroDivisionError):
                    logger.debug("unreadable %s/cpu.max: %r", here, text)
        if os.path.normpath(here) == os.path.normpath(root):
            return best
        here = os.path.dirname(here)


def _cgroup_v1(root: str, proc_lines: list[str]) -> float | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us of the v1 cpu controller; None if unlimited (-1)."""
    rel = "/"
    for ln in proc_lines:
        parts = ln.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            rel = parts[2]
    for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        base = os.path.join(root, mount)
        if not os.path.isdir(base):
            continue
        for here in (os.path.join(base, rel.lstrip("/")), base):
            quota, period = (_read(os.path.join(here, f"cpu.cfs_{k}_us"))
                             for k in ("quota", "period"))
            if quota is None or period is None:
                continue
            try:
                q, p = int(quota), int(period)
            except ValueError:
                return None
            return q / p if q > 0 and p > 0 else None
    return None
