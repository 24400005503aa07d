# Source on the GPU host: installs the carried wheels (scripts/fetch_wheels.sh) and kernelloop's path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export KERNELLOOP_CACHE=/tmp/kernelloop-cache
