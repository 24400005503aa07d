#!/usr/bin/env bash
# Build the project's CUDA code on a machine with nvcc but no GPU: the `nvcc` tests
# (tests/test_cuda_builds.py: the builtin proposer's CUDA candidates for tasks/seeds and
# tasks/level2, the critic's CUDA fixtures, adversarial samples) and, with BENCH=1, the CUDA
# build-speed benchmark. A CUDA build of torch (same version as the one installed) goes into
# $KERNELLOOP_CUDA_TORCH (default ~/.cache/kernelloop/cuda-torch), away from the environment
# the rest of the project uses. It needs about 5 GB of disk.
#
#   bash scripts/nvcc_check.sh                 # pytest -m nvcc
#   BENCH=1 bash scripts/nvcc_check.sh         # and scripts/bench_build.py --device cuda --arch 9.0a
#   (KERNELLOOP_CUDA_SPLIT=0 in front of bench_build.py: KernelBench-style sources built whole)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
fi
export CUDA_HOME
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "nvcc not found (set CUDA_HOME)" >&2; exit 2; }
target=${KERNELLOOP_CUDA_TORCH:-$HOME/.cache/kernelloop/cuda-torch}
version=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')
if ! PYTHONPATH="$target" python3 -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.__version__.startswith('$version') else 1)" 2>/dev/null; then
  echo "installing torch==$version (CUDA build) into $target"
  # --isolated: the default index's wheel for Linux is the CUDA build; a configured
  # find-links or extra index could hand back the CPU one.
  python3 -m pip install --isolated ${PIP_CERT:+--cert "$PIP_CERT"} -q --no-compile --target "$target" "torch==$version"
fi
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
# The CUDA libraries' headers (cusparse.h, cublas_v2.h, ... which ATen/cuda/CUDAContext.h
# includes) come with torch's nvidia wheels where the local toolkit lacks them: only those the
# toolkit lacks are put on the path, so its own cuda_runtime.h and friends still win.
extra="$target.include"
mkdir -p "$extra"
for inc in "$target"/nvidia/*/include; do
  for h in "$inc"/*; do
    name=$(basename "$h")
    [ -e "$CUDA_HOME/include/$name" ] || [ -e "$extra/$name" ] || ln -s "$h" "$extra/$name"
  done
done
export CPATH="$extra${CPATH:+:$CPATH}"
export KERNELLOOP_CACHE=${KERNELLOOP_CACHE:-$(mktemp -d -t kl-nvcc-XXXXXX)}
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
"$CUDA_HOME/bin/nvcc" --version | tail -1
python3 -m pytest -q -m nvcc tests/test_cuda_builds.py "$@"
# the KernelBench-style sources again with the split build off (sandbox/cuda_split.py; on by default)
KERNELLOOP_CUDA_SPLIT=0 python3 -m pytest -q -m nvcc tests/test_cuda_builds.py -k "kernelbench_style or adversarial" "$@"
if [ "${BENCH:-0}" = 1 ]; then
  python3 scripts/bench_build.py --device cuda --arch 9.0a --n "${BENCH_N:-3}"
fi
