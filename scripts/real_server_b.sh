#!/usr/bin/env bash
# Issue 25's full test (b): a slow llama-server (one thread, four slots of 8192 tokens, answers that
# run on to the window) and every client setting at its default, two seed tasks, one round of two
# samples: four answers at once at about 10-15 tokens/s each. CI runs the same test on one task
# (about 13 minutes on 2 cores); this one takes about twice that.
# Prints the run's figures (wall time, attempts, calls, tokens, errors, the server's account).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/llama_server.sh >/dev/null
KERNELLOOP_FULL_REAL_SERVER=1 KERNELLOOP_REQUIRE_REAL_SERVER=1 exec python3 -m pytest -q -s -p no:randomly \
  --timeout 3600 tests/test_real_server.py -k test_b "$@"
