#!/usr/bin/env bash
# The test command (README, .ci/run): set up from scratch, then run the whole suite.
# GPU tests are marked `gpu` and skip cleanly where torch sees no CUDA device. The real-server
# tests (`real_server`) need llama.cpp's llama-server: built here once per machine and cached
# (scripts/llama_server.sh, about 9 minutes on 2 cores the first time), so they run, not skip.
#
# With no arguments, the real-server tests run in a pytest of their own beside the rest of the
# suite: their time is the model server's generation (one or two threads), not the suite's work,
# and run one after the other the two parts took over 75 minutes on CI's 2 cores. After them the
# side runs a few build-heavy test files (below), so both lanes end at about the same time. The
# side's output is kept in a log whose tail is printed at the end; the command fails where either
# lane fails.
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
# Test files that build many C++ extensions and assert correctness only (the builtin's templates):
# the side runs them after the real-server tests, so that on CI's 2 cores the two lanes end at about
# the same time (stop 56: the suite alone 2,742 s, the side about 1,250 s of it; the first six files
# took about 600 s of the suite's cold-cache time; with them in the side the suite ended at 2,432 s,
# the side at 2,090, so the layout tests, about 290 s, moved too).
side_files=(tests/test_builtin_ops.py tests/test_builtin_precision.py tests/test_builtin_recurrent.py
            tests/test_builtin_conv.py tests/test_builtin_cpu_vector.py tests/test_builtin_pool.py
            tests/test_builtin_layout.py)
ignores=()
for f in "${side_files[@]}"; do ignores+=(--ignore "$f"); done
# The side (scripts/test_side.sh): the server's build (about 9 minutes on 2 cores the first time),
# then the real-server tests and the files above, each at a lower priority (nice 10), so that the
# suite's timed runs are not slowed by them; the build is not niced (niced beside the suite it took
# over 21 minutes, and the side ended last). Its own temporary folders and no cache writes, so the
# pytests share nothing of pytest's. A background job of a script starts with SIGINT ignored: it gets
# SIGINT's default action back, so that Ctrl-C (or the INT sent below) reaches the running pytest.
python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
  bash scripts/test_side.sh "$side_tmp" "${side_files[@]}" >"$side_log" 2>&1 &
side=$!
stop_side() { kill -INT "$side" 2>/dev/null; wait "$side" 2>/dev/null; tail -n 5 "$side_log"; }
trap 'stop_side; exit 130' INT
trap 'stop_side; exit 143' TERM
set +e
python3 -m pytest -q --timeout 1200 -m "not real_server" "${ignores[@]}"
main_rc=$?
echo
echo "== the side, run beside the suite above: the real-server tests (tests/test_real_server.py), then ${side_files[*]}; log: $side_log"
wait "$side"
side_rc=$?
trap - INT TERM
tail -n 25 "$side_log"
echo "== suite: exit $main_rc; side: exit $side_rc; $(( $(date +%s) - started )) s in all"
[ "$main_rc" = 0 ] && [ "$side_rc" = 0 ]
