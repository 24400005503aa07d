# Source on the GPU host: installs the carried wheels (scripts/fetch_wheels.sh) once per machine
# (scripts that call each other source this again) and puts them and kernelloop on the path.
if [ ! -f /tmp/site/.kernelloop-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  touch /tmp/site/.kernelloop-wheels
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export KERNELLOOP_CACHE=/tmp/kernelloop-cache
# the newest optimisation run in the store (replays are runs too); given task files, the newest over
# exactly those (by file name): a lane's store kept on the warm machine holds the last call's runs too
last_run() { python3 - "$@" <<'PY' 2>/dev/null
import json, os, sqlite3, sys
want = sorted(os.path.basename(p) for p in sys.argv[1:])
rows = sqlite3.connect(os.environ["KERNELLOOP_DB"]).execute(
    "select id, config from runs where kind = 'optimize' order by id desc").fetchall()
for run_id, config in rows:
    if not want or sorted(os.path.basename(t["path"]) for t in json.loads(config)["tasks"]) == want:
        print(run_id)
        break
PY
}
