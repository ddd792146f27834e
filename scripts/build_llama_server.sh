#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for tracekit's integration tests and engine checks, and prints its path.
#
# Source: the copy of llama.cpp vendored in the llama-cpp-python sdist from PyPI (a pinned, hashed registry
# package; no git clone needed). Static CPU build, no network features. Needs cmake and a C++ compiler;
# about 5 minutes on 2 idle cores (16.5 minutes measured on 2 cores shared with other jobs). Built once per
# machine into a cache directory outside the repository:
#   $TRACEKIT_CACHE (default ~/.cache/tracekit)/llama-server/<version>/llama-server
# Run again: prints the cached path at once. Usage: scripts/build_llama_server.sh [-j JOBS]
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs=2
[ "${1:-}" = "-j" ] && jobs="$2"
cache="${TRACEKIT_CACHE:-$HOME/.cache/tracekit}/llama-server/$version"
bin="$cache/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null || { echo "Error: $tool not found; install it to build llama-server" >&2; exit 3; }
done
mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building llama-server (llama-cpp-python $version sdist) in $work; log: $cache/build.log" >&2
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >"$cache/build.log" 2>&1
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
{
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  cmake --build "$work/build" --target llama-server -j"$jobs"
} >>"$cache/build.log" 2>&1 || { echo "Error: llama-server build failed; see $cache/build.log" >&2; exit 3; }
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
