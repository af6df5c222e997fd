#!/usr/bin/env bash
# Build llama.cpp's own programs that `nsd bench` runs as outside peers, from the same
# vendored source, patches and CPU flags as nsd's llama.cpp backend (scripts/install.sh),
# so a peer and nsd run the same kernels on the same GGUF files.
#
# Optional: only the `llama-speculative` peer needs it (about 5 minutes on 2 cores).
# Idempotent: the binaries are reused while the flags and patches match.
#
# Environment:
#   NSD_CACHE      cache root (default: ~/.cache/nsd); binaries go to $NSD_CACHE/llama-tools/bin
#   NSD_CPU_LEVEL  avx2: the AVX2-only build (as install.sh), into $NSD_CACHE/llama-tools-avx2
set -euo pipefail

TARGETS=(llama-speculative-simple)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${NSD_CACHE:-$HOME/.cache/nsd}"
OUT="$CACHE/llama-tools"
PY="$ROOT/.venv/bin/python"
if [[ "${NSD_CPU_LEVEL:-native}" == "avx2" ]]; then
    OUT="$CACHE/llama-tools-avx2"
    [[ -x "$ROOT/.venv-avx2/bin/python" ]] && PY="$ROOT/.venv-avx2/bin/python"
fi
[[ -x "$PY" ]] || PY="${PYTHON:-python3}"

say() { printf '[llama-tools] %s\n' "$*"; }

# CMAKE_ARGS, PATCH_SUM and llama_source (the patched source), shared with install.sh
source "$ROOT/scripts/llama_build.sh"
# The programs only: no tests, no web UI, no TLS; static so each binary stands alone.
CMAKE_ARGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
CMAKE_ARGS+=" -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release"

stamp="llama-cpp-python=$LLAMA_CPP_VERSION CMAKE_ARGS=$CMAKE_ARGS patches=$PATCH_SUM targets=${TARGETS[*]}"

up_to_date() {
    [[ -f "$OUT/BUILD_STAMP" && "$(cat "$OUT/BUILD_STAMP")" == "$stamp" ]] || return 1
    local t
    for t in "${TARGETS[@]}"; do [[ -x "$OUT/bin/$t" ]] || return 1; done
}
if up_to_date; then
    say "up to date: $OUT/bin"
    exit 0
fi

say "building ${TARGETS[*]} from llama-cpp-python $LLAMA_CPP_VERSION's llama.cpp"
say "CMAKE_ARGS=$CMAKE_ARGS"
mkdir -p "$CACHE"
tmp="$(mktemp -d "$CACHE/llama-tools-build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
src="$(llama_source "$tmp")"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
cmake -S "$src/vendor/llama.cpp" -B "$tmp/build" $CMAKE_ARGS > "$tmp/configure.log" \
    || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" --parallel "$(nproc 2>/dev/null || echo 2)" --target "${TARGETS[@]}" \
    > "$tmp/build.log" 2>&1 || { tail -n 40 "$tmp/build.log"; exit 1; }

# Replace the old binaries in one step, so a half-built set is never picked up.
rm -rf "$OUT.new"
mkdir -p "$OUT.new/bin"
for t in "${TARGETS[@]}"; do cp "$tmp/build/bin/$t" "$OUT.new/bin/"; done
printf '%s' "$stamp" > "$OUT.new/BUILD_STAMP"
rm -rf "$OUT"
mv "$OUT.new" "$OUT"
say "built: $OUT/bin (${TARGETS[*]})"
