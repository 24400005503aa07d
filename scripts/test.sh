#!/usr/bin/env bash
# The test command (README, .ci/run): set up from scratch, then run the whole suite.
# GPU tests are marked `gpu` and skip cleanly where torch sees no CUDA device. The real-server
# tests (`real_server`) need llama.cpp's llama-server: built here once per machine and cached
# (scripts/llama_server.sh, about 9 minutes on 2 cores the first time), so they run, not skip.
#
# With no arguments, the real-server tests run in a pytest of their own beside the rest of the
# suite: their time is the model server's generation (one or two threads), not the suite's work,
# and run one after the other the two parts took over 75 minutes on CI's 2 cores. Their output is
# kept in a log whose tail is printed at the end; the command fails where either part fails.
# KERNELLOOP_TESTS_SERIAL=1 runs everything in one pytest instead; arguments are passed to one
# pytest as they are (`bash scripts/test.sh tests/test_store.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export KERNELLOOP_REQUIRE_REAL_SERVER=1
if [ $# -gt 0 ] || [ "${KERNELLOOP_TESTS_SERIAL:-0}" = 1 ]; then
  bash scripts/llama_server.sh >/dev/null
  exec python3 -m pytest -q --timeout 1200 "$@"
fi
bash scripts/llama_server.sh --model-only >/dev/null     # the GGUF (the script's own tests read it)

side_log=$(mktemp -t kernelloop-real-server.XXXXXX.log)
side_tmp=$(mktemp -d -t kernelloop-real-server.XXXXXX)
started=$(date +%s)
# The server's build (about 9 minutes on 2 cores the first time) is the side's first step. Its own
# temporary folder and no cache writes, so the two pytests share nothing of pytest's. A
# background job of a script starts with SIGINT ignored: it gets SIGINT's default action back, so
# that Ctrl-C (or the INT sent below) stops it through pytest's own teardown (its servers stopped).
# The tests run at a lower priority (nice 10), so that the suite's timed runs are not slowed by the
# servers; the build does not (niced, it took over 21 minutes beside the suite, and the side ended last).
python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
  bash -c 'bash scripts/llama_server.sh >/dev/null && exec nice -n "${KERNELLOOP_REAL_SERVER_NICE:-10}" "$@"' side \
  python3 -m pytest -q --timeout 3600 -p no:cacheprovider --basetemp "$side_tmp" -m real_server tests \
  >"$side_log" 2>&1 &
side=$!
stop_side() { kill -INT "$side" 2>/dev/null; wait "$side" 2>/dev/null; tail -n 5 "$side_log"; }
trap 'stop_side; exit 130' INT
trap 'stop_side; exit 143' TERM
set +e
python3 -m pytest -q --timeout 1200 -m "not real_server"
main_rc=$?
echo
echo "== the real-server tests (tests/test_real_server.py), run beside the suite above; log: $side_log"
wait "$side"
side_rc=$?
trap - INT TERM
tail -n 25 "$side_log"
echo "== suite: exit $main_rc; real-server tests: exit $side_rc; $(( $(date +%s) - started )) s in all"
[ "$main_rc" = 0 ] && [ "$side_rc" = 0 ]
