#!/usr/bin/env bash
# Every GPU check in few device calls (each stage time-boxed so a call ends inside its limit).
# On the GPU host, with .whl carried (scripts/fetch_wheels.sh):
#   bash scripts/gpu_check.sh judge   # probe, containment, adversarial suite (pre-built), timing fidelity (~10 min)
#   bash scripts/gpu_check.sh build   # build speed (lean and KernelBench-style sources), throughput  (~7 min)
#   bash scripts/gpu_check.sh loop    # builtin optimisation (seeds + level2), then `post`
#   bash scripts/gpu_check.sh post    # the store's last optimisation run: replay, report, seed analysis, gpu tests of the rest
#   bash scripts/gpu_check.sh triton  # the Triton backend compiled: its tests and adversarial cases (~5 min)
#   PREC=fp32 BACKEND=triton bash scripts/gpu_check.sh triton-loop   # the builtin over KernelBench's ten-task
#       level-2 mix, 2 rounds, one call per (PREC fp32|bf16) x (BACKEND triton|cuda); carry .kb (a copy of
#       ../shared/KernelBench); `triton-table` then prints the four runs' tables side by side
# Each stage fits one device call (10 minutes); run them in separate calls. scripts/gpu_multi.sh
# runs them side by side on a host with several GPUs.
# Knobs: BASELINE=1 (seed baselines too: then run the suite in a second call, ADV_K), PREBUILD_S=0 (no parallel pre-build of the cuda cases), PREBUILD_P, CONTAIN_S, ADV_K (pytest -k for the adversarial cases), ADV_S,
# TIMING=0, BUILD_S, BUILD_N, BUILD_P (builds at once), BUILD_STYLES, THROUGHPUT_S, LOOP_S, ROUNDS, SAMPLES, TASKS,
# REPLAY=0, REST_S=0 (no remaining gpu tests); PIN (a prefix such as `taskset -c 48-63`).
# Logs and reports go to $OUT (or ./out); the store is $KERNELLOOP_DB (default $OUT/gpu.db, started from a
# carried .gpu-store/gpu.db where there is one: the four triton-loop runs then share footprints and one store).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
# A store carried from an earlier call (.gpu-store/gpu.db, git-ignored: copy a call's returned gpu.db
# there and carry .gpu-store) goes on: its task footprints spare the next runs their measurement.
[ -z "${KERNELLOOP_DB:-}" ] && [ -f .gpu-store/gpu.db ] && [ ! -f "$OUT/gpu.db" ] && cp .gpu-store/gpu.db "$OUT/gpu.db"
export PYTHONUNBUFFERED=1 KERNELLOOP_DB=${KERNELLOOP_DB:-$OUT/gpu.db} MAX_JOBS=${MAX_JOBS:-8}
KL="python3 -m kernelloop.cli"
PIN=${PIN:-}
stage=${1:-judge}
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" $PIN "$@"; echo "[exit $? after stage: $*]"; }
post() {
  local run; run=$(last_run)
  [ -n "$run" ] || { echo "no optimisation run in $KERNELLOOP_DB"; return 1; }
  [ "${REPLAY:-1}" = 1 ] && box 90 $KL replay "$run" --device cuda --no-compile --tasks seeds/conv2d_divide_leakyrelu 2>&1 \
    | grep -v USDT | tee "$OUT/replay.txt"
  $KL report "$run" --format md -o "$OUT/report.md" >/dev/null; $KL report "$run" --format html -o "$OUT/report.html" >/dev/null
  $KL show "$run" seeds/conv2d_bias_scale_sigmoid_groupnorm 2>&1 | tee "$OUT/analysis_seed.txt" | tail -5
  [ "${REST_S:-120}" != 0 ] && box ${REST_S:-120} python3 -m pytest -m gpu -q --timeout 120 -p no:cacheprovider tests \
    --deselect tests/test_sandbox_adversarial.py 2>&1 | grep -vE "USDT" | tail -15 | tee "$OUT/pytest_gpu_rest.txt"
  return 0
}
case "$stage" in
  judge)
    box 60 $KL device probe --device cuda 2>&1 | tee "$OUT/probe.txt"
    [ "${BASELINE:-0}" = 1 ] && box 150 $KL baseline tasks/seeds --device cuda 2>&1 | tee "$OUT/baseline.txt"
    # the cuda cases built side by side first: builds are cached by content, so the suite's evaluations
    # (one at a time, the device quiet for each) find them built and pay no nvcc
    [ "${PREBUILD_S:-150}" != 0 ] && box ${PREBUILD_S:-150} bash -c "ls tests/adversarial/cuda/*.py | xargs -P ${PREBUILD_P:-12} -I{} \
      $KL eval tests/adversarial/task_small.py {} --device cuda --build-only 2>&1 | grep -c ' built in ' || true"
    # containment on this host: cgroup v2 where writable, else the subreaper (not gpu-marked: CPU processes)
    box ${CONTAIN_S:-60} python3 -m pytest -q -p no:cacheprovider tests/test_containment.py 2>&1 | tail -4 | tee "$OUT/containment.txt"
    box ${ADV_S:-280} python3 -m pytest -m gpu -q -s --timeout 200 -p no:cacheprovider tests/test_sandbox_adversarial.py \
      ${ADV_K:+-k "$ADV_K"} 2>&1 | grep -vE "USDT|^$" | tee "$OUT/adversarial.txt" | grep -E "VERDICT|passed|failed|Error" | head -80
    [ "${TIMING:-1}" = 1 ] && box 150 python3 scripts/bench_timing.py --fidelity 2>&1 | tee "$OUT/bench_timing.txt"
    ;;
  build)
    box ${BUILD_S:-240} python3 scripts/bench_build.py --device cuda --n ${BUILD_N:-3} --parallel ${BUILD_P:-3} --styles ${BUILD_STYLES:-lean,torch} 2>&1 \
      | tee "$OUT/bench_build.txt"
    box ${THROUGHPUT_S:-240} python3 scripts/bench_throughput.py --device cuda --candidates 40 --kernels 10 2>&1 \
      | tee "$OUT/bench_throughput.txt"
    ;;
  loop)
    box ${LOOP_S:-360} $KL optimize ${TASKS:-tasks/seeds tasks/level2} --model builtin --rounds ${ROUNDS:-2} \
      --samples ${SAMPLES:-2} --device cuda 2>&1 | grep -v USDT | tee "$OUT/optimize.txt"
    post
    ;;
  post)
    post
    ;;
  triton)
    python3 -c "import triton; print('triton', triton.__version__)" || { echo "triton is not installed"; exit 1; }
    box ${ADV_S:-420} python3 -m pytest -m "gpu or triton" -q -s --timeout 300 -p no:cacheprovider \
      tests/test_sandbox_adversarial.py -k triton tests/test_triton_backend.py 2>&1 | grep -vE "USDT|^$" \
      | tee "$OUT/triton_tests.txt" | grep -E "VERDICT|passed|failed|Error" | head -80
    ;;
  triton-loop)
    # ten level-2 tasks (evals/kernelbench.py's mix) at KernelBench's sizes; one run per call, labelled in the store
    export KERNELLOOP_KERNELBENCH=${KERNELLOOP_KERNELBENCH:-$PWD/.kb}
    tasks=$(python3 -c "from evals.kernelbench import MIX, kernelbench_paths as p; print(' '.join(map(str, p(MIX))))") || exit 1
    box ${LOOP_S:-540} $KL optimize $tasks --model builtin --backend ${BACKEND:-triton} --precision ${PREC:-fp32} \
      --rounds ${ROUNDS:-2} --samples ${SAMPLES:-2} --device cuda 2>&1 | grep -v USDT \
      | tee "$OUT/optimize_${BACKEND:-triton}_${PREC:-fp32}.txt"
    ;;
  triton-table)
    python3 scripts/backend_table.py "$KERNELLOOP_DB" | tee "$OUT/triton_table.md"
    ;;
  *)
    echo "unknown stage $stage (judge, build, loop, post, triton, triton-loop, triton-table)"; exit 2
    ;;
esac
