# Sourced by install.sh and build_llama_tools.sh: sets CMAKE_ARGS for building the
# vendored llama.cpp on this CPU, so nsd's backend and llama.cpp's own programs (the
# benchmark peers) are built with the same flags.
#
# The default source build compiles ggml with -march=native, which is not what we want
# either way: a fixed flag list is not portable (AMD Zen 4 has AVX-512 VNNI but not
# AVX-VNNI, and a build with -mavxvnni dies there with "Illegal instruction"), and the
# AMX kernels crash unless patched. So native detection is off and we switch on exactly
# the x86 extensions this CPU reports.
#
# AMX (Intel Sapphire Rapids and later): ggml's AMX kernels crash on every decode when
# built with GCC < 13, because the tile configuration is loaded through an intrinsic whose
# 8-byte memory operand lets GCC drop the stores that fill it. scripts/patches/ holds the
# fix (load the whole 64-byte struct through inline asm); it is applied to the vendored
# llama.cpp source before every build, on every CPU, and the build stops if it no longer
# applies. AMX is switched on only where the CPU reports amx_tile and amx_int8.
# LLAVA_BUILD=OFF skips the multimodal library, which nsd does not use.
#
# NSD_CPU_LEVEL=avx2 builds for AVX2 (with FMA, F16C, BMI2) and leaves AVX-VNNI, AVX-512 and
# AMX out even where the CPU has them: the kernels of AVX2-only CPUs (AMD Zen 2/3, older
# Intel), runnable and testable on any recent x86 machine. Unset (or "native"): everything
# this CPU reports.
cpu_flags=""
if [[ "$(uname -m)" == "x86_64" && -r /proc/cpuinfo ]]; then
    cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
fi
case "${NSD_CPU_LEVEL:-native}" in
    native) ;;
    avx2)
        [[ -n "$cpu_flags" ]] || { echo "NSD_CPU_LEVEL=avx2 needs an x86-64 Linux CPU" >&2; exit 1; }
        cpu_flags="$(tr ' ' '\n' <<< "$cpu_flags" | grep -Ev '^(avx_vnni|avx512.*|amx.*)$' | tr '\n' ' ')"
        cpu_flags=" $cpu_flags "
        ;;
    *) echo "NSD_CPU_LEVEL must be native or avx2, got '$NSD_CPU_LEVEL'" >&2; exit 1 ;;
esac
has() { # has FLAG... : true when the CPU reports every FLAG
    local f
    for f in "$@"; do [[ "$cpu_flags" == *" $f "* ]] || return 1; done
}
onoff() { if has "$@"; then echo ON; else echo OFF; fi; }

if [[ -n "$cpu_flags" ]]; then
    CMAKE_ARGS="-DGGML_NATIVE=OFF"
    CMAKE_ARGS+=" -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2)"
    CMAKE_ARGS+=" -DGGML_FMA=$(onoff fma) -DGGML_F16C=$(onoff f16c)"
    CMAKE_ARGS+=" -DGGML_BMI2=$(onoff bmi2) -DGGML_AVX_VNNI=$(onoff avx_vnni)"
    # ggml's GGML_AVX512 means -mavx512f/cd/vl/dq/bw together.
    CMAKE_ARGS+=" -DGGML_AVX512=$(onoff avx512f avx512cd avx512vl avx512dq avx512bw)"
    CMAKE_ARGS+=" -DGGML_AVX512_VBMI=$(onoff avx512vbmi)"
    CMAKE_ARGS+=" -DGGML_AVX512_VNNI=$(onoff avx512_vnni)"
    CMAKE_ARGS+=" -DGGML_AVX512_BF16=$(onoff avx512_bf16)"
    if has amx_tile amx_int8; then
        CMAKE_ARGS+=" -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=$(onoff amx_bf16)"
    else
        CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    fi
else
    # Not x86-64 Linux: no AMX to worry about, the native build is fine.
    CMAKE_ARGS="-DGGML_NATIVE=ON"
fi
CMAKE_ARGS+=" -DLLAVA_BUILD=OFF"
