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
