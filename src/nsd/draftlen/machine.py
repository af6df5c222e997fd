"""The machine a figure was measured on.

Step costs, calibration caches and benchmark results hold only for the CPU they were
measured on: its model, its feature flags (they decide which kernels run) and its core
count. This module describes that machine from the platform and ``/proc/cpuinfo``.
"""

from __future__ import annotations

import hashlib
import os
import platform


def cpu_description() -> dict[str, str]:
    """CPU model and a digest of its feature flags: figures are only valid for these."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = value.strip()
    except OSError:
        pass
    amx = "amx_tile" in flags.split()
    return {"model": model, "flags_sha": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "amx": str(amx), "cores": str(os.cpu_count())}
