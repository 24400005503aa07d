#!/usr/bin/env bash
# The test command (README, .ci/run): set up from scratch, then run the whole suite.
# GPU tests are marked `gpu` and skip cleanly where torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q --timeout 1200 "$@"
