#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 from source into its own environment, bench/.venv-llamacpp,
# for bench/workers/llamacpp_worker.py. The build takes ~6 minutes on 2 cores; nothing else
# CPU-heavy (in particular no timing benchmark) should run meanwhile.
#
# By default the build is the one users get from `pip install llama-cpp-python`: native to the
# machine that builds it (GGML_NATIVE=ON: every instruction set this CPU has, AVX-512 and VNNI
# included where present), so a comparison against it is fair on every CPU. LLAMACPP_ISA=avx2
# builds, into bench/.venv-llamacpp-avx2, what a native build gives on an AVX2-only CPU such as AMD
# Zen 3 (SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no AVX-512): the peer of `bench/run.py --hide-avx512`.
# Those flags are spelled out because ggml turns them on by default only when GGML_NATIVE_DEFAULT
# is ON, which it is not when SOURCE_DATE_EPOCH is set (that would silently give an SSE2-only
# build). LLAMACPP_ISA=avx2-vnni builds, into bench/.venv-llamacpp-avx2-vnni, what a native build
# gives on Intel's client cores since Alder Lake (AVX2 and AVX-VNNI, no AVX-512): the peer of
# `bench/run.py --hide-avx512 --keep-avx-vnni`. LLAMACPP_ISA=native-no-amx is the native build
# without ggml's AMX kernels, into the native build's environment: on CPUs with AMX (Intel Xeon
# since Sapphire Rapids) version 0.3.36's AMX matrix product crashes on Q4_K_M weights (SIGSEGV in
# ggml_backend_amx_mul_mat, llama.cpp issue 20824), so there the native build cannot run the
# benchmark. No BLAS, CUDA or curl. The worker records llama.cpp's own system info (the kernels it
# chose) in every run.
#
#     bash bench/peers/llamacpp_setup.sh                     # PYTHON=python3.11 to choose the interpreter
#     LLAMACPP_ISA=avx2 bash bench/peers/llamacpp_setup.sh   # the AVX2-only build
#     LLAMACPP_ISA=avx2-vnni bash bench/peers/llamacpp_setup.sh   # AVX2 and AVX-VNNI
#     LLAMACPP_ISA=native-no-amx bash bench/peers/llamacpp_setup.sh   # native, AMX left out
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ISA="${LLAMACPP_ISA:-native}"
case "$ISA" in
    native|native-no-amx) VENV="$ROOT/bench/.venv-llamacpp" ;;
    avx2) VENV="$ROOT/bench/.venv-llamacpp-avx2" ;;
    avx2-vnni) VENV="$ROOT/bench/.venv-llamacpp-avx2-vnni" ;;
    *) echo "error: LLAMACPP_ISA is native, native-no-amx, avx2 or avx2-vnni, not $ISA" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
VERSION=0.3.36

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip

COMMON="-DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DLLAMA_CURL=OFF \
-DCMAKE_BUILD_TYPE=Release"
AVX2="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \
-DGGML_F16C=ON -DGGML_AVX512=OFF"
if [ "$ISA" = avx2 ]; then
    export CMAKE_ARGS="$AVX2 $COMMON"
elif [ "$ISA" = avx2-vnni ]; then
    export CMAKE_ARGS="$AVX2 -DGGML_AVX_VNNI=ON $COMMON"
elif [ "$ISA" = native-no-amx ]; then
    # explicit -mno-* flags win over -march=native in GCC and Clang, whatever their order
    export CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 \
-DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 $COMMON"
else
    export CMAKE_ARGS="-DGGML_NATIVE=ON $COMMON"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=2      # 2 compile jobs
export FORCE_CMAKE=1

# --no-binary: build from the sdist even if a wheel exists; --no-cache-dir: never reuse a wheel
# built earlier with other flags; the uninstall: pip would keep an installed build of this version,
# whatever its flags.
"$VENV/bin/python" -m pip uninstall -y llama-cpp-python
"$VENV/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"

"$VENV/bin/python" - <<'PY'
import llama_cpp
print("llama-cpp-python", llama_cpp.__version__)
print(llama_cpp.llama_print_system_info().decode())
PY
