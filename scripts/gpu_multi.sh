#!/usr/bin/env bash
# Every GPU check in one device call on a host with several GPUs (e.g. nvidia-h200-x4): the
# harness checks and benchmarks run on GPU 0 and 16 cores of their own (the "16-core host with
# one GPU" the build and throughput goals name), while the optimisation loop runs on the other
# GPUs and cores at the same time. A second call with RESUME=1 continues the loop on every GPU
# (the store is kept outside $OUT, on the warm machine) and then replays, reports and runs the
# remaining gpu tests.
#
#   bash scripts/gpu_multi.sh              # judge + build on GPU 0, loop on GPUs 1..N-1
#   RESUME=1 bash scripts/gpu_multi.sh     # finish the loop on all GPUs; replay, report, gpu tests
#
# Knobs: LOOP_S (seconds the loop may run in this call), ROUNDS, SAMPLES, TASKS; ADV_K (pytest -k for the
# adversarial cases), ADV_S, TIMING=0, BUILD_S, BUILD_N, BUILD_STYLES, THROUGHPUT_S; POST=1 reports the run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export PYTHONUNBUFFERED=1 KERNELLOOP_DB=${KERNELLOOP_DB:-/tmp/kernelloop-gpu/gpu.db}
mkdir -p "$(dirname "$KERNELLOOP_DB")"
KL="python3 -m kernelloop.cli"
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" "$@"; echo "[exit $? after: $*]"; }
ngpu=$(nvidia-smi -L | wc -l); ncpu=$(nproc)
echo "$ngpu GPU(s), $ncpu cores"; nvidia-smi -L
last_run() { python3 -c "import sqlite3,os;print(sqlite3.connect(os.environ['KERNELLOOP_DB']).execute(\"select max(id) from runs where kind = 'optimize'\").fetchone()[0] or '')" 2>/dev/null; }

if [ "${RESUME:-0}" = 0 ]; then
  loop_gpus=$(seq -s, 1 $((ngpu - 1)))
  (
    export CUDA_VISIBLE_DEVICES=$loop_gpus
    box ${LOOP_S:-540} taskset -c 0-$((ncpu - 17)) $KL optimize ${TASKS:-tasks/seeds tasks/level2} --model builtin \
      --rounds ${ROUNDS:-3} --samples ${SAMPLES:-2} --device cuda 2>&1 | grep -v USDT > "$OUT/optimize.txt"
  ) &
  loop_pid=$!
  (
    export CUDA_VISIBLE_DEVICES=0 MAX_JOBS=16
    pin="taskset -c $((ncpu - 16))-$((ncpu - 1))"
    box 60 $pin $KL device probe --device cuda 2>&1 | tee "$OUT/probe.txt"
    box ${ADV_S:-240} $pin python3 -m pytest -m gpu -q -s --timeout 200 -p no:cacheprovider tests/test_sandbox_adversarial.py ${ADV_K:+-k "$ADV_K"} 2>&1 \
      | grep -vE "USDT|^$" > "$OUT/adversarial.txt"; grep -E "VERDICT|passed|failed" "$OUT/adversarial.txt" | tail -40
    [ "${TIMING:-1}" = 1 ] && box 60 $pin python3 scripts/bench_timing.py 2>&1 | tee "$OUT/bench_timing.txt"
    box ${BUILD_S:-120} $pin python3 scripts/bench_build.py --device cuda --n ${BUILD_N:-3} --styles ${BUILD_STYLES:-lean,torch} 2>&1 | tee "$OUT/bench_build.txt"
    box ${THROUGHPUT_S:-100} $pin python3 scripts/bench_throughput.py --device cuda --candidates 40 --kernels 10 2>&1 | tee "$OUT/bench_throughput.txt"
  ) 2>&1 | tee "$OUT/judge.txt"
  wait $loop_pid
  tail -45 "$OUT/optimize.txt"
  if [ "${POST:-0}" = 1 ]; then          # report and the seed analysis of this call's run
    run=$(last_run)
    $KL report "$run" --format md -o "$OUT/report.md" >/dev/null; $KL report "$run" --format html -o "$OUT/report.html" >/dev/null
    $KL show "$run" seeds/conv2d_bias_scale_sigmoid_groupnorm > "$OUT/analysis_seed.txt" 2>&1
  fi
else
  run=$(last_run)
  box ${LOOP_S:-300} $KL optimize --resume "$run" 2>&1 | grep -v USDT > "$OUT/optimize_resume.txt"; tail -45 "$OUT/optimize_resume.txt"
  box 60 $KL replay "$run" --device cuda --no-compile --tasks seeds/conv2d_divide_leakyrelu 2>&1 | grep -v USDT | tee "$OUT/replay.txt"
  $KL report "$run" --format md -o "$OUT/report.md" >/dev/null; $KL report "$run" --format html -o "$OUT/report.html" >/dev/null
  $KL show "$run" seeds/conv2d_bias_scale_sigmoid_groupnorm > "$OUT/analysis_seed.txt" 2>&1
  box ${REST_S:-100} python3 -m pytest -m gpu -q --timeout 100 -p no:cacheprovider tests --deselect tests/test_sandbox_adversarial.py 2>&1 \
    | grep -vE "USDT" | tail -15 | tee "$OUT/pytest_gpu_rest.txt"
fi
cp "$KERNELLOOP_DB" "$OUT/gpu.db" 2>/dev/null
