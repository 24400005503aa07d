#!/usr/bin/env bash
# Issue 25's full test (b): a slow llama-server (one thread, four slots) and every client setting
# at its default, two seed tasks, one round of two samples. CI runs the same test on one task.
# Prints the run's figures (wall time, attempts, calls, tokens, errors, the server's account).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/llama_server.sh >/dev/null
KERNELLOOP_FULL_B=1 KERNELLOOP_REQUIRE_REAL_SERVER=1 exec python3 -m pytest -q -s -p no:randomly \
  --timeout 3600 tests/test_real_server.py -k test_b "$@"
