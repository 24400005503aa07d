#!/usr/bin/env bash
# The side lane of scripts/test.sh, run beside the suite: llama.cpp's server built (cached), the
# real-server tests (marker real_server), then the test files given as arguments (build-heavy files
# that assert correctness only), each pytest at nice 10 with its own temporary folder under $1 and no
# cache writes. Exits non-zero where either pytest failed. SIGINT or SIGTERM reaches the running
# pytest as SIGINT (its teardown stops its servers): a script's background jobs start with SIGINT
# ignored, so each pytest is started with SIGINT's default action restored.
set -u
cd "$(dirname "$0")/.."
base=$1
shift
bash scripts/llama_server.sh >/dev/null || exit $?
child=
forward() { [ -n "$child" ] && kill -INT "$child" 2>/dev/null; wait "$child" 2>/dev/null; exit 130; }
trap forward INT TERM
lane() {   # lane NAME PYTEST-ARGS...: one niced pytest, waited for; its exit status
  local name=$1
  shift
  python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
    nice -n "${KERNELLOOP_REAL_SERVER_NICE:-10}" python3 -m pytest -q -p no:cacheprovider --basetemp "$base/$name" "$@" &
  child=$!
  wait "$child"
}
lane real_server --timeout 3600 -m real_server tests
server_rc=$?
files_rc=0
if [ $# -gt 0 ]; then
  echo "== the side's build-heavy test files: $*"
  lane files --timeout 1200 -m "not real_server" "$@"
  files_rc=$?
fi
echo "== side: real-server tests exit $server_rc; build-heavy test files exit $files_rc"
[ "$server_rc" = 0 ] && [ "$files_rc" = 0 ]
