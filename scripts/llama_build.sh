# Sourced by install.sh and build_llama_tools.sh: the one way nsd gets a patched llama.cpp
# source tree. Both build from the llama.cpp vendored in the same llama-cpp-python release,
# with the same patches (scripts/patches/*.patch, applied in glob order) and the same CPU
# flags (llama_cmake_args.sh, which this file sources), so nsd's backend and llama.cpp's own
# programs run the same kernels.
#
# Sets: LLAMA_CPP_VERSION, CMAKE_ARGS, PATCHES (the patch files), PATCH_SUM (their digest).
# Needs: ROOT (the repository), PY (a python with pip), and a say() function for messages.

LLAMA_CPP_VERSION="0.3.36"

source "$ROOT/scripts/llama_cmake_args.sh"

PATCHES=("$ROOT"/scripts/patches/*.patch)
PATCH_SUM="$(cat "${PATCHES[@]}" | sha256sum | cut -d' ' -f1)"

# llama_source DIR: download llama-cpp-python's sdist into DIR, unpack it there and apply
# every patch; prints the source folder. Stops (exit 1) if a patch no longer applies.
llama_source() {
    local dir="$1" src p
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$dir/sdist" \
        "llama-cpp-python==$LLAMA_CPP_VERSION" >&2
    tar -xzf "$dir"/sdist/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz -C "$dir"
    src="$dir/llama_cpp_python-$LLAMA_CPP_VERSION"
    for p in "${PATCHES[@]}"; do
        say "applying $(basename "$p")" >&2
        if ! patch --batch --forward --silent -p1 -d "$src" < "$p" >&2; then
            say "ERROR: $(basename "$p") no longer applies to llama-cpp-python $LLAMA_CPP_VERSION;" >&2
            say "       update the patch (or drop it if upstream fixed the problem) before building." >&2
            exit 1
        fi
    done
    printf '%s\n' "$src"
}
