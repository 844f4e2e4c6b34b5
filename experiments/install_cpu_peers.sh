#!/usr/bin/env bash
# Benchmark-only peers for experiments/real_model_bench.py, installed outside kvjax:
#   bash experiments/install_cpu_peers.sh [PREFIX]      (default PREFIX: ./peers; ~35 min on 2 cores)
# - PREFIX/llamacpp-venv: llama-cpp-python 0.3.36 built from its sdist (the native build
#   segfaults on these VMs, so the ISA is named explicitly; no AVX-512 / AMX);
# - PREFIX/llama-server: llama.cpp's own server, built from the same sdist's vendored source.
# kvjax never imports either; the benchmark runs them as separate processes.
set -euo pipefail
prefix=$(realpath -m "${1:-peers}")
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF"
mkdir -p "$prefix/sdist"
# The sdist alone: --no-binary :all: would also build its build tools (scikit-build-core,
# hatchling, setuptools...) from source just to read its metadata.
[ -f "$prefix"/sdist/llama_cpp_python-0.3.36.tar.gz ] || python -m pip download -q --no-deps \
    --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$prefix/sdist"
if [ ! -x "$prefix/llamacpp-venv/bin/python" ] || ! "$prefix/llamacpp-venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python -m venv "$prefix/llamacpp-venv"
  "$prefix/llamacpp-venv/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=2 "$prefix/llamacpp-venv/bin/pip" install -q \
      "$prefix"/sdist/llama_cpp_python-0.3.36.tar.gz
fi
if [ ! -x "$prefix/llama-server" ]; then
  src="$prefix/src"; rm -rf "$src"; mkdir -p "$src"
  tar -xzf "$prefix"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$src" --strip-components=1
  cmake -S "$src/vendor/llama.cpp" -B "$src/build" $flags -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build "$src/build" --target llama-server -j2
  cp "$src/build/bin/llama-server" "$prefix/llama-server"
fi
echo "peers ready under $prefix"
