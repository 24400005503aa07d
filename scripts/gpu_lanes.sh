#!/usr/bin/env bash
# Independent GPU checks side by side in one device call: lane i runs its command on GPU i with
# 16 cores of its own (cores 16i..16i+15, `taskset`), its own store (/tmp/lane_i.db, kept on the
# warm machine and returned as $OUT/lane_i.db) and its own output folder ($OUT/lane_i, exported
# as OUT, so scripts that write under $OUT keep their lanes apart). A 4-GPU host runs four checks
# for the device time of one. Each lane's output goes to $OUT/lane_i.txt, whose tail is printed
# when every lane has ended.
#
#   bash scripts/gpu_lanes.sh "bash scripts/gpu_scale.sh bench" "python3 scripts/aa_check.py --device cuda"
#
# A lane's command runs under bash with scripts/gpu_env.sh sourced, KERNELLOOP_KERNELBENCH=$PWD/.kb,
# `named TASK...` (KernelBench task names -> paths, e.g. `named level3/1_MLP`) and `box SECONDS CMD...`
# (CMD itself gets SIGINT after SECONDS, so `optimize` stops cleanly and its store stays whole: box every
# long step; the lane's own limit, LANE_S + 40 s, is a last resort that reaches only the lane's shell).
# A whole level split over the lanes: `share level2` lists lane i's tasks of the level (every N-th
# file in task-number order from the i-th, N the number of lanes: $LANE and $LANES), and `suite SECONDS ARGS`
# runs `optimize` on them for at most SECONDS (boxed: `box` cannot run a shell function itself),
# resuming the lane's last run over those same tasks where the call carried its store back in
# ($STORES/lane_i.db, else lane_i.db.xz, e.g. .gpu-store/l2) or a call before it on the warm machine left one; SUITE=level2
# by default:
#
#   STORES=.gpu-store/l2 bash scripts/gpu_lanes.sh 'suite 505 --rounds 4 --samples 1' 'suite 505 --rounds 4 --samples 1' ...
# Write nothing through `| tail`: the lane's file keeps everything and its tail is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
ngpu=$(nvidia-smi -L | wc -l)
[ "$#" -le "$ngpu" ] || { echo "gpu_lanes: $# lanes for $ngpu GPU(s)"; exit 2; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
echo "$ngpu GPU(s), $(nproc) cores; commit of the tree: $(git log -1 --format=%h 2>/dev/null) (stale on the device)"
pids=()
i=0
for cmd in "$@"; do
  mkdir -p "$OUT/lane_$i"
  (
    export CUDA_VISIBLE_DEVICES=$i OUT="$OUT/lane_$i" KERNELLOOP_DB=/tmp/lane_$i.db PYTHONUNBUFFERED=1 MAX_JOBS=16
    export KERNELLOOP_KERNELBENCH=$PWD/.kb LANE=$i LANES=$#
    if [ -n "${STORES:-}" ] && [ -f "$STORES/lane_$i.db" ]; then cp "$STORES/lane_$i.db" /tmp/lane_$i.db
    elif [ -n "${STORES:-}" ] && [ -f "$STORES/lane_$i.db.xz" ]; then xz -dc "$STORES/lane_$i.db.xz" > /tmp/lane_$i.db; fi
    echo "lane $i (GPU $i, cores $((16 * i))-$((16 * i + 15))): $cmd"
    timeout --kill-after=10 $(( ${LANE_S:-540} + 40 )) taskset -c $((16 * i))-$((16 * i + 15)) bash -c "
      source scripts/gpu_env.sh
      box() { local t=\$1; shift; timeout --signal=INT --kill-after=30 \"\$t\" \"\$@\"; echo \"[exit \$? after: \$*]\"; }
      named() { python3 -c 'import sys; from evals.kernelbench import kernelbench_paths as p; print(\" \".join(map(str, p(sys.argv[1:]))))' \"\$@\"; }
      share() { ls .kb/\$1/*.py | sort -V | awk -v i=\$LANE -v n=\$LANES '(NR - 1) % n == i'; }
      suite() { local t=\$1 r=\$(last_run \$(share \${SUITE:-level2})); shift; box \$t python3 -m kernelloop.cli optimize \$(share \${SUITE:-level2}) --model builtin \${r:+--resume \$r} \"\$@\"; }
      $cmd"
    echo "[lane $i exit $?]"
    # a consistent copy, the write-ahead log's pages included (a store cut off mid-run may have them there)
    [ -f /tmp/lane_$i.db ] && python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
      /tmp/lane_$i.db "$OUT/../lane_$i.db"
    # a file over 16 MiB does not come back from the device (a level-2 run's store passes it by its second
    # call): such a store comes back as lane_i.db.xz (a few per cent of its size), which STORES also resumes
    if [ -f "$OUT/../lane_$i.db" ] && [ "$(stat -c %s "$OUT/../lane_$i.db")" -gt $((15 << 20)) ]; then
      xz -T4 -6 -f "$OUT/../lane_$i.db" && echo "lane $i: its store came back as lane_$i.db.xz (xz -dk to read it)"
    fi
  ) 2>&1 | grep -v USDT > "$OUT/lane_$i.txt" &
  pids+=($!)
  i=$((i + 1))
done
wait "${pids[@]}"
for j in $(seq 0 $((i - 1))); do echo "===== lane $j"; tail -c "${TAIL:-2500}" "$OUT/lane_$j.txt"; done
