"""Build-speed benchmark: a one-kernel candidate built by plain ``load_inline`` defaults and by
the sandbox's build path, side by side in one run, each build in a fresh process with a unique
source (no cache hits). Prints medians and the ratio.

    python scripts/bench_build.py --device cuda --n 3
    python scripts/bench_build.py --device cuda --n 3 --parallel 3   # the three builds of each kind at once
    python scripts/bench_build.py --device cuda --arch 9.0   # nvcc and a CUDA torch, no GPU needed
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor

KERNEL_LEAN = r'''
__global__ void scale_add(const float* x, float* y, float s, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * s + 1.0f;   // SALT
}
void scale_add_launch(const float* x, float* y, float s, long n) {
  scale_add<<<(n + 255) / 256, 256>>>(x, y, s, n);
}
'''
CPP_LEAN = r'''
void scale_add_launch(const float* x, float* y, float s, long n);
torch::Tensor scale_add(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  scale_add_launch(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, x.numel());
  return y;
}
'''
# KernelBench style: the wrapper lives in the .cu file, which includes torch.
KERNEL_TORCH = r'''
#include <torch/extension.h>
__global__ void scale_add(const float* x, float* y, float s, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * s + 1.0f;   // SALT
}
torch::Tensor scale_add(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  long n = x.numel();
  scale_add<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
  return y;
}
'''
CPP_TORCH = "torch::Tensor scale_add(torch::Tensor x, double s);"
CPU_SRC = r'''
torch::Tensor scale_add(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (long i = 0; i < x.numel(); ++i) q[i] = p[i] * (float)s + 1.0f;  // SALT
  return y;
}
'''

CHILD = r'''
import json, os, sys, time
mode, style, device, salt, cache = sys.argv[1:6]
srcs = json.loads(sys.stdin.read())
from torch.utils import cpp_extension
if mode == "sandbox":
    from sandbox.build import HookedBuilder
    b = HookedBuilder(cache_root=cache, max_jobs=int(os.environ.get("KERNELLOOP_BUILD_JOBS", "4")))
    b.install()
kwargs = dict(name="bench_" + salt, cpp_sources=[srcs["cpp"].replace("SALT", salt)], functions=["scale_add"])
if srcs.get("cuda"):
    kwargs["cuda_sources"] = [srcs["cuda"].replace("SALT", salt)]
t0 = time.perf_counter()
mod = cpp_extension.load_inline(**kwargs)
print(json.dumps({"seconds": time.perf_counter() - t0}))
'''


def build_once(mode: str, style: str, device: str, cache: str, arch: str | None = None) -> float:
    if device == "cuda":
        srcs = {"cpp": CPP_LEAN, "cuda": KERNEL_LEAN} if style == "lean" else {"cpp": CPP_TORCH, "cuda": KERNEL_TORCH}
    else:
        srcs = {"cpp": CPU_SRC}
    salt = uuid.uuid4().hex[:12]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch      # both modes: what plain load_inline detects on that GPU
    elif mode == "plain":
        env.pop("TORCH_CUDA_ARCH_LIST", None)
        env.pop("MAX_JOBS", None)
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, "plain")
    out = subprocess.run([sys.executable, "-c", CHILD, mode, style, device, salt, cache], input=json.dumps(srcs),
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{mode}/{style} build failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--styles", default="lean,torch")
    ap.add_argument("--parallel", type=int, default=1,
                    help="builds at once (each in its own process; plain and sandbox alike): on a host with many "
                         "cores this shortens the benchmark, not the builds")
    ap.add_argument("--arch", default=None,
                    help="CUDA arch for both modes (e.g. 9.0): build CUDA candidates on a host with nvcc but no GPU, "
                         "as plain load_inline would on that GPU")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kl-bench-build-")
    styles = args.styles.split(",") if args.device == "cuda" else ["cpp"]
    rows = []
    def batch(mode: str, style: str) -> list[float]:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            return list(pool.map(lambda _: build_once(mode, style, args.device, cache, args.arch), range(args.n)))

    for style in styles:
        plain = batch("plain", style)
        # The first sandbox build also makes the precompiled headers (once per torch install and flags).
        warm = build_once("sandbox", style, args.device, cache, args.arch)
        ours = batch("sandbox", style)
        p, o = statistics.median(plain), statistics.median(ours)
        rows.append((style, p, o, warm))
        print(f"[{args.device}/{style}] plain load_inline median {p:.1f} s {['%.1f' % x for x in plain]}; "
              f"sandbox median {o:.1f} s {['%.1f' % x for x in ours]} (first, making the PCH: {warm:.1f} s); "
              f"ratio plain/sandbox {p / o:.2f}x")
    print(json.dumps({"device": args.device, "results": [
        {"style": s, "plain_median_s": p, "sandbox_median_s": o, "sandbox_first_s": w, "ratio": p / o}
        for s, p, o, w in rows]}))


if __name__ == "__main__":
    main()
