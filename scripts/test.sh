#!/usr/bin/env bash
# The test command (README, .ci/run): set up from scratch, then run the whole suite.
# GPU tests are marked `gpu` and skip cleanly where torch sees no CUDA device. The real-server
# tests (`real_server`) need llama.cpp's llama-server: built here once per machine and cached
# (scripts/llama_server.sh, about 5 minutes on 2 cores the first time), so they run, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/llama_server.sh >/dev/null
export KERNELLOOP_REQUIRE_REAL_SERVER=1
exec python3 -m pytest -q --timeout 1200 "$@"
