#!/usr/bin/env bash
# Install kernelloop and its dependencies from scratch.
# torch: an existing install (a CUDA build on a GPU host) is kept; otherwise torch==2.13.0,
# which on these machines is the CPU wheel (a plain `pip install torch` would pull CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# mcp: kernelloop mcp and its tests (tests/test_mcp.py starts it through the SDK's own client)
"$PY" -m pip install -q -e ".[test,cluster,mcp]"
# On a GPU host, NVML for the quiet-device check (sandbox/quiet.py); the CPU target does not use it.
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[gpu]"
fi
# The PostgreSQL store's tests start a real server: Debian's postgresql package (its binaries only;
# the tests run their own server in a temporary folder, nothing is started here).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
      || echo "warning: postgresql could not be installed; the PostgreSQL store tests will be skipped" >&2
  fi
fi
# The HTML report's browser test needs a headless Chromium (Debian's package).
if [ "${KERNELLOOP_SKIP_BROWSER:-0}" != "1" ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: chromium could not be installed; the browser test will fail in CI" >&2
  fi
fi
