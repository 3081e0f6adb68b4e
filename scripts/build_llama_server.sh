#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (parallel slots, continuous batching) from the llama.cpp
# sources that llama-cpp-python's sdist vendors, for `kvmemory bench serve --llama-server PATH`.
# Not part of CI: it downloads the sdist from PyPI and compiles for several minutes.
#
#   scripts/build_llama_server.sh OUTDIR [LLAMA_CPP_PYTHON_VERSION]
#
# Leaves OUTDIR/llama-server (statically linked against ggml/llama; no shared libs to carry).
# ISA is spelled out and AMX is off (see /work/shared/llamacpp.md: -march=native dies with
# "Illegal instruction" on VMs that advertise AMX without enabling it). On an AVX2-only CPU set
# KVM_LLAMA_AVX512=OFF. PYTHON (default python3) is the interpreter whose pip downloads the sdist;
# JOBS (default 2) the build parallelism; WORK (default a temp dir) where the sources are built.
set -euo pipefail

OUT=${1:?usage: $0 OUTDIR [LLAMA_CPP_PYTHON_VERSION]}
VERSION=${2:-0.3.36}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
AVX512=${KVM_LLAMA_AVX512:-ON}
WORK=${WORK:-$(mktemp -d /tmp/llama-server-build.XXXXXX)}

mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  # --no-binary for this package only: its build dependencies may come as wheels (":all:" would build
  # scikit-build-core, cmake and the rest from source first)
  "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK"
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$WORK"

cmake -S "$SRC" -B "$WORK/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512="$AVX512" -DGGML_AVX512_VNNI="$AVX512" -DGGML_AVX512_BF16="$AVX512" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
cmake --build "$WORK/build" --config Release --target llama-server -j "$JOBS"

cp "$WORK/build/bin/llama-server" "$OUT/llama-server"
echo "llama-cpp-python $VERSION (vendored llama.cpp), AVX512=$AVX512, AMX off" > "$OUT/BUILD_INFO"
"$OUT/llama-server" --version 2>&1 | tee -a "$OUT/BUILD_INFO" || true
ldd "$OUT/llama-server" || true
echo "built $OUT/llama-server"
