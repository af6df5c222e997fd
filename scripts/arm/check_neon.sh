#!/usr/bin/env bash
# Builds scripts/arm/neon_small_batch.c for aarch64 and runs its correctness test under QEMU:
# the NEON (SDOT) mapping of nsd's small-batch kernels, checked for batch invariance and
# against plain C. Correctness only: QEMU's speed says nothing about an ARM CPU's.
#
# Needs Debian's cross compiler and user-mode QEMU:
#   apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
set -euo pipefail
cd "$(dirname "$0")"
for tool in aarch64-linux-gnu-gcc qemu-aarch64; do
    command -v "$tool" > /dev/null || {
        echo "check_neon: $tool not found (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)" >&2
        exit 2
    }
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# -ffp-contract=off: the plain-C reference must not be fused where the source does not say so
aarch64-linux-gnu-gcc -O2 -march=armv8.2-a+dotprod -ffp-contract=off -Wall -Wextra -Werror -static \
    -o "$out/neon_small_batch" neon_small_batch.c -lm
qemu-aarch64 -cpu max "$out/neon_small_batch"
