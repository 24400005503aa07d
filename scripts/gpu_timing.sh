#!/usr/bin/env bash
# Issue 38 on one GPU host, in one device call (< 9 min on an H100). Carry .whl (scripts/fetch_wheels.sh)
# and .kb (`cp -r ../shared/KernelBench .kb`, git-ignored):
#   bash scripts/gpu_timing.sh
# 1. builds first, side by side on the CPU: the adversarial suite's cuda cases and the builtin candidates of
#    the four shortest level-2 tasks (plain load_inline builds for KernelBench's harness, and the sandbox's);
#    the device probe meanwhile;
# 2. kernelloop's eager vs a plain PyTorch event timing vs triton's do_bench, 12 KernelBench tasks, one process
#    (scripts/bench_timing.py);
# 3. KernelBench's own harness (.kb/src, unchanged) vs kernelloop, speedups of the same builtin candidates on
#    level2/24, 71, 6, 79 (scripts/kb_harness.py);
# 4. the adversarial suite with the legitimate CUDA-graph and side-stream candidates (pytest -m gpu).
# Figures and logs go to $OUT (or ./out). Knobs: BUILD_S, TIMING_S, KB_S, ADV_S (seconds per stage), ADV_K.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export PYTHONUNBUFFERED=1 KERNELLOOP_DB=${KERNELLOOP_DB:-/tmp/kernelloop-timing.db} MAX_JOBS=${MAX_JOBS:-8}
export KERNELLOOP_KERNELBENCH=${KERNELLOOP_KERNELBENCH:-$PWD/.kb}
KL="python3 -m kernelloop.cli"
box() { local t=$1; shift; timeout --signal=INT --kill-after=20 "$t" "$@"; echo "[exit $? after: $*]"; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee "$OUT/device.txt"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$OUT/device.txt"
# 1. builds (CPU) side by side, and the probe
timeout ${BUILD_S:-150} bash -c "ls tests/adversarial/cuda/*.py | xargs -P ${PREBUILD_P:-8} -I{} $KL eval \
    tests/adversarial/task_small.py {} --device cuda --build-only 2>&1 | grep -c ' built in '" > "$OUT/prebuild_adversarial.txt" 2>&1 &
adv=$!
box ${BUILD_S:-150} python3 scripts/kb_harness.py --build-only 2>&1 | grep -v USDT | tee "$OUT/prebuild_kb.txt" &
kb=$!
box 60 $KL device probe --device cuda 2>&1 | tee "$OUT/probe.txt"
wait $kb $adv; echo "adversarial cases built: $(cat "$OUT/prebuild_adversarial.txt")"
# 2. the timing comparison
box ${TIMING_S:-150} python3 scripts/bench_timing.py --json "$OUT/bench_timing.json" 2>&1 | grep -v USDT \
  | tee "$OUT/bench_timing.txt"
# 3. KernelBench's harness vs kernelloop
box ${KB_S:-120} python3 scripts/kb_harness.py --json "$OUT/kb_harness.json" 2>&1 | grep -vE "USDT|^\[(Eval|Profiling|Compilation)" \
  | tee "$OUT/kb_harness.txt"
# 4. the adversarial suite, legitimate graph / side-stream candidates included
box ${ADV_S:-170} python3 -m pytest -m gpu -q -s --timeout 150 -p no:cacheprovider tests/test_sandbox_adversarial.py \
  ${ADV_K:+-k "$ADV_K"} 2>&1 | grep -vE "USDT|^$" | tee "$OUT/adversarial.txt" | grep -E "VERDICT|passed|failed|Error" | head -80
