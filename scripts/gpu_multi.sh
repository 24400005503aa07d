#!/usr/bin/env bash
# Every GPU check in one device call on a host with several GPUs (e.g. nvidia-h200-x4): the
# stages `judge` and `build` of scripts/gpu_check.sh each run on a GPU and 16 cores of their own
# (the "16-core host with one GPU" the build and throughput goals name; on fewer than 4 GPUs both
# share GPU 0, one after the other), while the optimisation loop runs on the other GPUs and
# cores at the same time. A second call with RESUME=1 continues the
# loop on every GPU (the store is kept outside $OUT, on the warm machine), then runs gpu_check's
# `post` stage (replay, report, seed analysis, the remaining gpu tests).
#
#   bash scripts/gpu_multi.sh              # judge on GPU 0, build on GPU 1, loop on the others
#   RESUME=1 bash scripts/gpu_multi.sh     # finish the loop on all GPUs; replay, report, gpu tests
#
# Knobs: LOOP_S (seconds the loop may run in this call), ROUNDS, SAMPLES, TASKS; POST=1 reports
# the run at the end of the first call; gpu_check.sh's knobs (ADV_K, BUILD_S, ...) pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export PYTHONUNBUFFERED=1 KERNELLOOP_DB=${KERNELLOOP_DB:-/tmp/kernelloop-gpu/gpu.db}
mkdir -p "$(dirname "$KERNELLOOP_DB")"
KL="python3 -m kernelloop.cli"
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" "$@"; echo "[exit $? after: $*]"; }
ngpu=$(nvidia-smi -L | wc -l); ncpu=$(nproc)
echo "$ngpu GPU(s), $ncpu cores"; nvidia-smi -L

if [ "${RESUME:-0}" = 0 ]; then
  # lanes of 16 cores: judge on GPU 0 and the last 16 cores; with 4 GPUs or more, build and
  # throughput on GPU 1 and the 16 cores before those; the loop on the other GPUs and cores
  if [ "$ngpu" -ge 4 ]; then first_loop=2; else first_loop=1; fi
  loop_gpus=$(seq -s, $first_loop $((ngpu - 1)))
  (
    export CUDA_VISIBLE_DEVICES=$loop_gpus
    box ${LOOP_S:-540} taskset -c 0-$((ncpu - 16 * first_loop - 1)) $KL optimize ${TASKS:-tasks/seeds tasks/level2} \
      --model builtin --rounds ${ROUNDS:-3} --samples ${SAMPLES:-2} --device cuda 2>&1 | grep -v USDT > "$OUT/optimize.txt"
  ) &
  loop_pid=$!
  build_lane() {
    BUILD_S=${BUILD_S:-240} THROUGHPUT_S=${THROUGHPUT_S:-200} bash scripts/gpu_check.sh build
  }
  if [ "$first_loop" = 2 ]; then
    ( export CUDA_VISIBLE_DEVICES=1 MAX_JOBS=16 PIN="taskset -c $((ncpu - 32))-$((ncpu - 17))"; build_lane ) \
      > "$OUT/build_lane.txt" 2>&1 &
    build_pid=$!
  fi
  (
    export CUDA_VISIBLE_DEVICES=0 MAX_JOBS=16 PIN="taskset -c $((ncpu - 16))-$((ncpu - 1))"
    BASELINE=0 ADV_S=${ADV_S:-240} TIMING=${TIMING:-1} bash scripts/gpu_check.sh judge
    [ "$first_loop" = 1 ] && build_lane
  ) 2>&1 | tee "$OUT/judge.txt"
  [ "$first_loop" = 2 ] && { wait $build_pid; cat "$OUT/build_lane.txt"; }
  wait $loop_pid
  tail -45 "$OUT/optimize.txt"
  # report and the seed analysis of this call's run
  [ "${POST:-0}" = 1 ] && REPLAY=0 REST_S=0 bash scripts/gpu_check.sh post >/dev/null
else
  run=$(last_run)
  box ${LOOP_S:-300} $KL optimize --resume "$run" 2>&1 | grep -v USDT > "$OUT/optimize_resume.txt"; tail -45 "$OUT/optimize_resume.txt"
  REST_S=${REST_S:-100} bash scripts/gpu_check.sh post
fi
cp "$KERNELLOOP_DB" "$OUT/gpu.db" 2>/dev/null
