#!/usr/bin/env bash
# Every GPU check in few device calls. On the GPU host (see scripts/fetch_wheels.sh):
#   bash scripts/gpu_check.sh judge     # probe, baselines, pytest -m gpu, build/timing/throughput benchmarks
#   bash scripts/gpu_check.sh loop      # builtin optimisation over seeds + level2, replay, report
# Logs and the store go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export PYTHONUNBUFFERED=1 KERNELLOOP_DB="$OUT/gpu.db"
KL="python3 -m kernelloop.cli"
stage=${1:-judge}
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
case "$stage" in
  judge)
    $KL device probe --device cuda 2>&1 | tee "$OUT/probe.txt"
    $KL baseline tasks/seeds --device cuda 2>&1 | tee "$OUT/baseline.txt"
    python3 -m pytest -m gpu -q -rA --timeout 600 -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt" | grep -E "VERDICT|passed|failed|PASSED|FAILED|ERROR|error" | head -120
    python3 scripts/bench_build.py --device cuda --n 3 2>&1 | tee "$OUT/bench_build.txt"
    python3 scripts/bench_timing.py 2>&1 | tee "$OUT/bench_timing.txt"
    python3 scripts/bench_throughput.py --device cuda --candidates 40 --kernels 10 2>&1 | tee "$OUT/bench_throughput.txt"
    ;;
  loop)
    $KL optimize tasks/seeds tasks/level2 --model builtin --rounds ${ROUNDS:-3} --samples ${SAMPLES:-2} --device cuda 2>&1 | tee "$OUT/optimize.txt"
    run=$($KL runs -n 1 | grep -oE '^│ *[0-9]+' | grep -oE '[0-9]+' | head -1)
    $KL replay "$run" --device cuda --tasks seeds/conv2d_divide_leakyrelu --tasks seeds/gemm_sigmoid_gemm_logsumexp 2>&1 | tee "$OUT/replay.txt"
    $KL report "$run" --format md -o "$OUT/report.md" && $KL report "$run" --format html -o "$OUT/report.html"
    $KL show "$run" seeds/conv2d_bias_scale_sigmoid_groupnorm 2>&1 | tee "$OUT/analysis_seed.txt"
    ;;
esac
