#!/usr/bin/env bash
# The numerics checks on a GPU host (issue: numbers on KernelBench's terms), in stages that each
# fit one device call. Carry .whl (scripts/fetch_wheels.sh) and a KernelBench checkout: here
# `cp -r ../shared/KernelBench .kb` (ignored), carried as .kb; KERNELLOOP_KERNELBENCH points at it.
#   bash scripts/gpu_numerics.sh baselines   # baseline default (eager + compile) and strict (eager) over the mix + 2
#   bash scripts/gpu_numerics.sh verdicts    # the verdict table (tests/test_numerics_gpu.py); eval vs baseline eager
#   bash scripts/gpu_numerics.sh optimize    # the builtin over the mix in default mode (RESUME=RUN continues one;
#                                            # TASKS="level2/35_... level2/5_..." a subset of names instead)
# Logs and JSON figures go to $OUT (or ./out); the store ($KERNELLOOP_DB, default
# /tmp/kernelloop-numerics.db, outside $OUT so a warm machine keeps it between calls) is copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export PYTHONUNBUFFERED=1 KERNELLOOP_DB=${KERNELLOOP_DB:-/tmp/kernelloop-numerics.db} MAX_JOBS=${MAX_JOBS:-8}
export KERNELLOOP_KERNELBENCH=${KERNELLOOP_KERNELBENCH:-$PWD/.kb}
KL="python3 -m kernelloop.cli"
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" "$@"; echo "[exit $? after: $*]"; }
mix() { python3 -c "from evals.kernelbench import MIX, NUMERICS_EXTRA, kernelbench_paths as p; print(' '.join(map(str, p(MIX${1:+ + NUMERICS_EXTRA}))))"; }
named() { python3 -c "import sys; from evals.kernelbench import kernelbench_paths as p; print(' '.join(map(str, p(sys.argv[1:]))))" $TASKS; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
case "${1:-baselines}" in
  baselines)
    box 60 $KL device probe --device cuda 2>&1 | tail -3
    box ${DEFAULT_S:-330} $KL baseline $(mix extra) --device cuda --math default 2>&1 | grep -v USDT | tee "$OUT/baseline_default.txt"
    box ${STRICT_S:-150} $KL baseline $(mix extra) --device cuda --math strict --no-compile 2>&1 | grep -v USDT | tee "$OUT/baseline_strict.txt"
    ;;
  verdicts)
    KERNELLOOP_VERDICTS=$OUT/verdicts.json box ${VERDICT_S:-420} python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      --timeout 400 tests/test_numerics_gpu.py 2>&1 | grep -E "NUMERICS|passed|failed|Error" | tee "$OUT/verdicts.txt"
    # `eval` and `baseline` give the same eager for a task: the gemm_fp32 candidate on level2/12 under default
    box 120 $KL eval "$KERNELLOOP_KERNELBENCH/level2/17_Conv2d_InstanceNorm_Divide.py" tests/numerics/cuda/conv_full_fp32.py \
      --device cuda --no-compile 2>&1 | grep -v USDT | tee "$OUT/eval_level2_17.txt"
    ;;
  optimize)
    if [ -n "${RESUME:-}" ]; then args="--resume $RESUME"; else args="$(if [ -n "${TASKS:-}" ]; then named; else mix; fi) --model builtin --rounds ${ROUNDS:-1} --samples ${SAMPLES:-2} --device cuda"; fi
    box ${LOOP_S:-540} $KL optimize $args 2>&1 | grep -v USDT | tee -a "$OUT/optimize.txt"
    ;;
  *) echo "unknown stage $1 (baselines, verdicts, optimize)"; exit 2 ;;
esac
cp "$KERNELLOOP_DB" "$OUT/" 2>/dev/null
