"""The NEON (SDOT) mapping of nsd's small-batch kernels, scripts/arm/neon_small_batch.c,
built for aarch64 and run under user-mode QEMU: rows of a batch bitwise equal to the row
alone and to the kernels' order in plain C, and within rounding of the exact product.
Skipped where Debian's cross compiler or QEMU is not installed (see scripts/arm/check_neon.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "arm" / "check_neon.sh"

pytestmark = pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
    reason="no aarch64 cross compiler or qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu "
           "libc6-dev-arm64-cross qemu-user)")


def test_neon_kernels_are_batch_invariant_and_match_plain_c_under_qemu() -> None:
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok"
    for kind in ("q4_0x4", "q8_0"):
        assert any(line.startswith(f"{kind}: rows of batches of 1..16 bitwise equal") for line in lines)
    assert not any(line.startswith("FAIL") for line in lines)
