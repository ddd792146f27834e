#!/usr/bin/env bash
# Packs the llama.cpp source that bench/gpu_study/llamacpp_cuda.py builds on the GPU machine (which has
# no internet): the copy vendored in the llama-cpp-python sdist (the one scripts/build_llama_server.sh
# builds for the CPU), stripped to what `cmake --build --target llama-server` with the CPU and CUDA
# backends needs, plus llama.cpp's gguf-py beside it (the GPU image has no `gguf` package: the GGUF
# converter imports it from PYTHONPATH).
#
#   bash bench/gpu_study/pack_llama_src.sh [OUT_DIR]     # default: .llama-pack (git-ignored)
#
# Writes OUT_DIR/llama.cpp-src.tar.gz (~10 MB) and OUT_DIR/gguf-py/. Left out: docs, models (vocab
# test files), media, tests, benches, examples, pocs, the web UI's sources and tests (the build flags
# turn the UI off), the server's tests, and every ggml backend but CPU and CUDA (their CMake is only
# entered when that backend is switched on). The sdist comes from PyPI (pip download, pinned version)
# unless LLAMA_SDIST names an already downloaded llama_cpp_python-VERSION.tar.gz.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out="${1:-.llama-pack}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist="${LLAMA_SDIST:-}"
if [ -z "$sdist" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
  sdist="$work/llama_cpp_python-$version.tar.gz"
fi
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "Error: $sdist has no vendor/llama.cpp" >&2; exit 3; }
rm -rf "$out/gguf-py"
cp -r "$src/gguf-py" "$out/gguf-py"
rm -rf "$out/gguf-py/tests" "$out/gguf-py/examples"
(
  cd "$src"
  rm -rf docs models media tests benches examples pocs gguf-py conversion skills ci requirements \
    tools/ui/src tools/ui/tests tools/ui/package-lock.json tools/server/tests tools/server/bench .github
  for b in ggml/src/ggml-*/; do
    case "$b" in ggml/src/ggml-cpu/ | ggml/src/ggml-cuda/) ;; *) rm -rf "$b" ;; esac
  done
  # LLAMA_BUILD_TESTS/EXAMPLES are off; the top-level CMakeLists still names these directories
  mkdir -p tests examples pocs
  echo "# stripped by pack_llama_src.sh" >tests/CMakeLists.txt
  cp tests/CMakeLists.txt examples/CMakeLists.txt
  cp tests/CMakeLists.txt pocs/CMakeLists.txt
)
# ggml/src/CMakeLists.txt calls ggml_add_backend() for every backend whose option is on (all off but
# CPU and CUDA here); the directories of the others are never entered.
tar -czf "$out/llama.cpp-src.tar.gz.tmp" -C "$(dirname "$src")" llama.cpp
mv "$out/llama.cpp-src.tar.gz.tmp" "$out/llama.cpp-src.tar.gz"
du -sh "$out/llama.cpp-src.tar.gz" "$out/gguf-py" >&2
echo "$out/llama.cpp-src.tar.gz"
