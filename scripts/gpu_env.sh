# Source on the GPU host: installs the carried wheels (scripts/fetch_wheels.sh) once per machine
# (scripts that call each other source this again) and puts them and kernelloop on the path.
if [ ! -f /tmp/site/.kernelloop-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  touch /tmp/site/.kernelloop-wheels
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export KERNELLOOP_CACHE=/tmp/kernelloop-cache
# the newest optimisation run in the store (replays are runs too)
last_run() { python3 -c "import sqlite3,os;print(sqlite3.connect(os.environ['KERNELLOOP_DB']).execute(\"select max(id) from runs where kind = 'optimize'\").fetchone()[0] or '')" 2>/dev/null; }
