#!/usr/bin/env bash
# Issue 20's GPU goals on a lent one-GPU machine (nvidia-h100-x1 or nvidia-h200): a Ray cluster of
# two nodes on this host, each its own `ray start` process: the head with CPU resources only, a
# worker node that owns the GPU (and the build CPUs).
#   bash scripts/gpu_ray.sh install  # carry .whl-ray (bash scripts/fetch_wheels.sh ray): installs Ray into
#                                    # /tmp/site-ray, which stays on the warm machine for the next calls
#   bash scripts/gpu_ray.sh bench    # carry .whl .kb: scripts/bench_kernelbench.py through --executor ray, then
#                                    # --executor local, in this call; prints the ratio (goal >= 0.9) and whether
#                                    # every candidate got the same status (and which flags differ); TASKS x CANDIDATES
#                                    # (default 6 x 4), MAX_S (no candidate starts after it), PARALLEL (in flight),
#                                    # BENCH_S (each mode's box, default MAX_S + 200: proposals and footprints too)
#   bash scripts/gpu_ray.sh faults   # carry .whl .kb: optimize --executor ray; the worker's raylet is SIGKILLed
#                                    # mid-evaluation and started again; the run must complete with each attempt
#                                    # evaluated exactly once (python -m executors.audit)
# .whl-ray (about 42 MB), .whl and .kb fit one call together; install stays a stage of its own.
# On a host with several GPUs, WORKERS=2 (issue 36) starts two worker nodes, each its own `ray start`
# owning half the GPUs (CUDA_VISIBLE_DEVICES) and half the cores (taskset); the local executor it is compared with
# sees the same GPUs and cores (GPUS=2,3 to use some of them only). `faults` then kills the last worker node only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE_RAY=/tmp/site-ray
stage=${1:-bench}

if [ "$stage" = install ]; then
  ls .whl-ray/*.whl >/dev/null 2>&1 || { echo "carry .whl-ray (bash scripts/fetch_wheels.sh ray)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_RAY" .whl-ray/*.whl \
    && PYTHONPATH=$SITE_RAY python3 -c "import ray; print('ray', ray.__version__, 'installed in $SITE_RAY')"
  exit $?
fi

source scripts/gpu_env.sh || exit 1
[ -d "$SITE_RAY/ray" ] || { echo "Ray is not installed on this machine: run 'bash scripts/gpu_ray.sh install' first"; exit 2; }
export PYTHONPATH=$SITE_RAY:$PYTHONPATH PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-8} RAY_USAGE_STATS_ENABLED=0
export KERNELLOOP_KERNELBENCH=${KERNELLOOP_KERNELBENCH:-$PWD/.kb}
RAY="python3 $SITE_RAY/bin/ray"
PORT=${RAY_PORT:-6390}
export RAY_ADDRESS=127.0.0.1:$PORT
# Token authentication with a token of this run's own, as tests/raycluster.py does: Ray 2.60's `ray start
# --head` turns token mode on by itself whenever ~/.ray/auth_token exists (a driver's ray.init() writes one),
# while a worker's `ray start --address` does not (the tests' worker nodes failed with InvalidAuthToken on CI).
RAY_TOKEN_DIR=$(mktemp -d); head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RAY_TOKEN_DIR/auth_token"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$RAY_TOKEN_DIR/auth_token; unset RAY_AUTH_TOKEN
WORKER_MARK=kl_gpu_worker
CPUS=$(nproc)
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" "$@"; echo "[exit $? after: $*]"; }
named() { python3 -c "import sys; from evals.kernelbench import kernelbench_paths as p; print(' '.join(map(str, p(sys.argv[1:]))))" "$@"; }

start_head() {
  CUDA_VISIBLE_DEVICES="" $RAY start --head --port="$PORT" --num-cpus=2 --num-gpus=0 --include-dashboard=false \
    --disable-usage-stats >"$OUT/ray_head.log" 2>&1 || { tail -20 "$OUT/ray_head.log"; exit 1; }
}
WORKERS=${WORKERS:-1}
# GPUS: the GPUs the cluster and the local run it is compared with use (default every GPU); the cores
# are those the script may run on (run it under taskset to give it fewer)
GPU_IDS=(${GPUS:-$(seq -s, 0 $(( $(nvidia-smi -L 2>/dev/null | wc -l) - 1 )) )}); GPU_IDS=(${GPU_IDS[0]//,/ })
NGPU=${#GPU_IDS[@]}; [ "$NGPU" -ge 1 ] || { GPU_IDS=(0); NGPU=1; }
[ "$WORKERS" -le "$NGPU" ] || { echo "WORKERS=$WORKERS but $NGPU GPU(s) are given"; exit 2; }
export CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${GPU_IDS[*]}")
PER_GPUS=$((NGPU / WORKERS)); PER_CPUS=$((CPUS / WORKERS))
start_worker() {    # start_worker [I]: worker node I (default the last) owns the I-th PER_GPUS of the GPUs and PER_CPUS cores
  local i=${1:-$((WORKERS - 1))}
  local gpus; gpus=$(IFS=,; echo "${GPU_IDS[*]:$((i * PER_GPUS)):$PER_GPUS}")
  # pinned to its own cores, as a separate machine's would be (its slots size their builds on them)
  CUDA_VISIBLE_DEVICES=$gpus taskset -c $((i * PER_CPUS))-$(((i + 1) * PER_CPUS - 1)) \
    $RAY start --address="$RAY_ADDRESS" --num-cpus="$PER_CPUS" --num-gpus="$PER_GPUS" \
    --resources="{\"${WORKER_MARK}_$i\": 1}" --disable-usage-stats >>"$OUT/ray_worker.log" 2>&1 \
    || { tail -20 "$OUT/ray_worker.log"; exit 1; }
  echo "worker node $i: GPUs $gpus, $PER_CPUS cores"
}
worker_raylet() {   # the last worker node's raylet: the raylet whose command line carries its resource
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = raylet ] \
      && tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q "${WORKER_MARK}_$((WORKERS - 1))\b" && basename "$p"
  done
}
descendants() { local kids; kids=$(ps -o pid= --ppid "$1" 2>/dev/null); for k in $kids; do echo "$k"; descendants "$k"; done; }
kill_worker() {     # SIGKILL the raylet and every process under it (its actors and their sandbox workers)
  local r; r=$(worker_raylet | head -1)
  [ -n "$r" ] || { echo "no worker raylet found"; return 1; }
  local family="$r $(descendants "$r" | tr '\n' ' ')"
  echo "killing the worker node: raylet $r and $(echo $family | wc -w) process(es)"
  kill -9 $family 2>/dev/null
}
stop_cluster() { $RAY stop --force >/dev/null 2>&1; }   # this machine holds only this script's cluster
trap stop_cluster EXIT

python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
start_head; for i in $(seq 0 $((WORKERS - 1))); do start_worker "$i"; done
$RAY status 2>&1 | grep -E "CPU|GPU" | head -4

case "$stage" in
  bench)
    # one footprint store for both: the first run measures each task's footprint before its mode (timed
    # apart), the second reads them, so neither rate carries that step
    rm -f /tmp/ray-bench-footprints.db
    common=(--device cuda --tasks "${TASKS:-6}" --candidates "${CANDIDATES:-4}" --modes pipelined --db /tmp/ray-bench-footprints.db
            ${MAX_S:+--max-seconds $MAX_S} ${PARALLEL:+--parallel $PARALLEL})
    # Ray first: it runs on the colder host (the inductor cache is shared and warms for the second).
    # Each mode's box holds the builtin's proposals (72 s for 10 x 8 on an H100 host) and, for the first,
    # the footprint step (76 s) besides the run: session t's boxes of 255-275 s ended Ray's run early
    BENCH_S=${BENCH_S:-$(( ${MAX_S:-90} + 200 ))}
    box $BENCH_S python3 scripts/bench_kernelbench.py "${common[@]}" --executor ray --json "$OUT/bench_ray.json" 2>&1 \
      | grep -v USDT | tee "$OUT/bench_ray.txt" | tail -8
    box $BENCH_S python3 scripts/bench_kernelbench.py "${common[@]}" --executor local --json "$OUT/bench_local.json" 2>&1 \
      | grep -v USDT | tee "$OUT/bench_local.txt" | tail -8
    python3 - "$OUT/bench_ray.json" "$OUT/bench_local.json" <<'EOF' | tee "$OUT/bench_ratio.txt"
import json, sys
ray, local = (json.load(open(p))["modes"][0] for p in sys.argv[1:3])
ratio = ray["per_min"] / local["per_min"] if local["per_min"] else 0.0
status = lambda v: {k: x.split("+")[0] for k, x in v.items()}      # noqa: E731 - a verdict's status
same = status(ray["verdicts"]) == status(local["verdicts"])
print(f"ray {ray['per_min']} candidates/min, local {local['per_min']}: ratio {ratio:.2f} (goal >= 0.9: "
      f"{'met' if ratio >= 0.9 else 'NOT met'}); statuses {'the same' if same else 'DIFFER'}; flags "
      f"{'the same' if ray['verdicts'] == local['verdicts'] else 'differ (below)'}")
if ray["verdicts"] != local["verdicts"]:
    for k in sorted(set(ray["verdicts"]) | set(local["verdicts"])):
        if ray["verdicts"].get(k) != local["verdicts"].get(k):
            print(f"  {k}: ray {ray['verdicts'].get(k)} local {local['verdicts'].get(k)}")
            for name, run in (("ray", ray), ("local", local)):
                for why in run.get("flag_reasons", {}).get(k, []):
                    print(f"    {name}: {why}")
print("phases ray:  ", ray["phases_median_s"]); print("phases local:", local["phases_median_s"])
EOF
    ;;
  faults)
    DB=/tmp/kl-ray-faults.db; EV=$OUT/ray_events.jsonl; rm -f "$DB" "$EV"
    TASKS_F=$(named ${FAULT_TASKS:-level2/12_Gemm_Multiply_LeakyReLU level2/81_Gemm_Swish_Divide_Clamp_Tanh_Clamp})
    KERNELLOOP_RAY_EVENTS=$EV timeout --signal=INT 480 python3 -m kernelloop.cli optimize $TASKS_F --model builtin \
      --rounds 1 --samples "${SAMPLES:-3}" --device cuda --executor ray --db "$DB" >"$OUT/faults_run.txt" 2>&1 &
    cli=$!
    for _ in $(seq 600); do grep -q '"evaluate"' "$EV" 2>/dev/null && break; sleep 0.5; done
    sleep "${KILL_AFTER_S:-3}"                 # into the evaluation: the slot holds the candidate's checks
    kill_worker; sleep 5; start_worker; echo "worker node started again"
    wait $cli; echo "[optimize exit $?]"; tail -15 "$OUT/faults_run.txt" | grep -v USDT
    echo "events: $(grep -c '"lost"' "$EV") lost, $(grep -c '"done"' "$EV") done, $(grep -c '"slot_back"' "$EV") slot back"
    RUN=$(python3 -c "import sqlite3; print(sqlite3.connect('$DB').execute('select max(id) from runs').fetchone()[0])")
    python3 -m executors.audit "$RUN" --db "$DB" | tee "$OUT/faults_audit.json"
    cp "$DB" "$OUT/" 2>/dev/null
    ;;
  *) echo "unknown stage $stage (install, bench, faults)"; exit 2 ;;
esac
