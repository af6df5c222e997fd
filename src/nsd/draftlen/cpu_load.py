"""How busy the machine was with *other* work while a timed call ran.

CPU timings are only comparable when nothing else competes for the cores. Around each
timed call we read the system-wide busy CPU time and this process's own CPU time (which
includes the inference threads); the difference is what other processes used. A record
whose share of other load exceeds a threshold is flagged, and the report counts them.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import psutil

_MIN_WINDOW_S = 0.25


@dataclass(frozen=True)
class LoadSample:
    other_cpu: float  # other processes' CPU use, as a fraction of all cores (0..1)
    own_cpu: float  # this process's CPU use, as a fraction of all cores
    loadavg_start: float  # 1-minute load average before the call
    loadavg_end: float
    flagged: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _busy(times) -> float:
    idle = times.idle + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _own(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return float("nan")


class LoadMonitor:
    """``with monitor.measure() as box: ...`` then ``box.sample`` holds the reading."""

    def __init__(self, max_other_cpu: float = 0.25) -> None:
        self.max_other_cpu = max_other_cpu
        self.cores = psutil.cpu_count() or 1
        self._process = psutil.Process()

    def measure(self) -> "_Measurement":
        return _Measurement(self)


class _Measurement:
    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor = monitor
        self.sample: LoadSample | None = None

    def __enter__(self) -> "_Measurement":
        self._load = _loadavg()
        self._sys = _busy(psutil.cpu_times())
        self._own = _own(self.monitor._process)
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t
        sys_busy = _busy(psutil.cpu_times()) - self._sys
        own = _own(self.monitor._process) - self._own
        capacity = max(wall, 1e-9) * self.monitor.cores
        # Clock ticks are coarse (10 ms): clamp the small negative noise of short calls.
        other = min(max(sys_busy - own, 0.0) / capacity, 1.0)
        # Below ~0.25 s the 10 ms ticks cannot resolve a share of the cores: never flag.
        flagged = wall >= _MIN_WINDOW_S and other > self.monitor.max_other_cpu
        self.sample = LoadSample(other_cpu=other, own_cpu=min(own / capacity, 1.0),
                                 loadavg_start=self._load, loadavg_end=_loadavg(), flagged=flagged)
