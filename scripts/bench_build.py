"""Build-speed benchmark: a candidate built by plain ``load_inline`` defaults and by the sandbox's
build path, side by side in one run, each build with a unique source (no cache hits). Prints, per
candidate style, the medians of each step and the ratio:

* ``plain``: ``load_inline`` as torch ships it, in a fresh process (the time of the call);
* ``sandbox, first``: the sandbox's build hook (``sandbox.build``) the first time on this cache:
  it makes the precompiled headers (once per torch install, compiler and flags); ``second``: the
  next build, which makes the precompiled header of the C++ file's leading includes where they are
  more than the lean binding header (the builtin's; ``sandbox.pch``);
* ``sandbox``: the hook with the precompiled headers made (the steady state), with the median
  seconds of each translation unit (``main.o``: the C++ file and its bindings; ``cuda.cuda.o``:
  the CUDA file; the ``.so``: the link) from ninja's log, and the precompiled headers its C++ file
  takes (``sandbox.pch.headers_used``: any GCC skipped is printed with GCC's reason);
* with ``--workers``, the whole build stage of an evaluation (``Sandbox.build_only``: a build
  worker, the candidate's module executed, the hook's build, the reply): ``worker cold`` starts
  its worker for the build (Python and torch's import paid in the build), ``worker warm`` takes
  one started ahead, as the sandbox does while it evaluates (``sandbox.pool``).

Styles: ``lean`` (kernels in the ``.cu``, torch in the C++ file), ``torch`` (KernelBench: the
wrapper in the ``.cu``, which includes torch), ``builtin`` (the builtin proposer's candidate for a
task of ``tasks/level2``, several fused kernels and the GEMM path: what ``bench_kernelbench.py``
builds), ``cpp`` (``--device cpu``: a C++ kernel).

    python scripts/bench_build.py --device cuda --n 3 --styles lean,torch,builtin --workers
    python scripts/bench_build.py --device cuda --n 3 --parallel 3   # the three builds of each kind at once
    python scripts/bench_build.py --device cuda --arch 9.0a  # nvcc and a CUDA torch, no GPU needed
    python scripts/bench_build.py --device cpu --styles cpp,builtin --workers
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    b = HookedBuilder(cache_root=os.path.join(cache, "builds"),
                      max_jobs=int(os.environ.get("KERNELLOOP_BUILD_JOBS", "4")))
    b.install()
spent, dirs, names = [], [], ["bench_" + salt]
if srcs.get("module"):          # a whole candidate module (the builtin's): its load_inline calls timed
    inner = cpp_extension.load_inline
    def timed(*a, **k):
        names[:] = [k.get("name", a[0] if a else "")]
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)
    cpp_extension.load_inline = timed
    exec(compile(srcs["module"], "candidate.py", "exec"), {"__name__": "candidate"})
    seconds = sum(spent)
else:
    kwargs = dict(name="bench_" + salt, cpp_sources=[srcs["cpp"].replace("SALT", salt)], functions=["scale_add"])
    if srcs.get("cuda"):
        kwargs["cuda_sources"] = [srcs["cuda"].replace("SALT", salt)]
    t0 = time.perf_counter()
    mod = cpp_extension.load_inline(**kwargs)
    seconds = time.perf_counter() - t0
if mode == "sandbox":
    dirs = [r.directory for r in b.records]
else:
    dirs = [cpp_extension._get_build_directory(n, False) for n in names]
print(json.dumps({"seconds": seconds, "dirs": dirs}))
'''
BUILTIN_TASK = "tasks/level2/gemm_layernorm_gelu.py"


def builtin_source(device: str, salt: str) -> str:
    """The builtin proposer's candidate for ``BUILTIN_TASK``, made unique by ``salt`` (a comment in
    each of its sources and its extension's name): a real build every time."""
    import re

    from agent.builtin import generate
    from sandbox.tasks import read_spec

    src = generate(read_spec(BUILTIN_TASK), device).source
    src = re.sub(r'(_C(?:PP|UDA)_SOURCE = r""")', lambda m: f"{m.group(1)}\n// salt {salt}", src)
    return re.sub(r'name="([A-Za-z_]\w*)"', lambda m: f'name="{m.group(1)}_{salt}"', src, count=1)


def ninja_steps(directory: str) -> dict[str, float]:
    """Seconds per ninja target of the last build in ``directory`` (main.o, cuda.cuda.o, the .so)."""
    steps: dict[str, float] = {}
    try:
        lines = open(os.path.join(directory, ".ninja_log")).read().splitlines()[1:]
    except OSError:
        return steps
    for line in lines:
        start, end, _, out, _ = line.split("\t")
        steps["link" if out.endswith(".so") else out] = (int(end) - int(start)) / 1000
    return steps


def build_once(mode: str, style: str, device: str, cache: str, arch: str | None = None) -> dict:
    salt = uuid.uuid4().hex[:12]
    if style == "builtin":
        srcs = {"module": builtin_source(device, salt)}
    elif device == "cuda":
        srcs = {"cpp": CPP_LEAN, "cuda": KERNEL_LEAN} if style == "lean" else {"cpp": CPP_TORCH, "cuda": KERNEL_TORCH}
    else:
        srcs = {"cpp": CPU_SRC}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch      # both modes: what plain load_inline detects on that GPU
    elif mode == "plain":
        env.pop("TORCH_CUDA_ARCH_LIST", None)
    if mode == "plain":
        env.pop("MAX_JOBS", None)
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, "plain")
    out = subprocess.run([sys.executable, "-c", CHILD, mode, style, device, salt, cache], input=json.dumps(srcs),
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{mode}/{style} build failed:\n{out.stderr[-3000:]}")
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    steps: dict[str, float] = {}
    for d in reply.get("dirs", []):
        for k, v in ninja_steps(d).items():
            steps[k] = steps.get(k, 0.0) + v
    return {"seconds": reply["seconds"], "steps": steps, "dirs": reply.get("dirs", [])}


def worker_builds(style: str, device: str, cache: str, arch: str | None, n: int, warm: bool) -> list[float]:
    """``n`` build stages through ``Sandbox.build_only`` (one build slot), with the build worker
    started for each build (``warm`` False) or taken warm from the sandbox's build pool (each
    build waits until its worker is ready, as in a pipelined run whose builds keep it filled)."""
    import time

    from sandbox.evaluate import Sandbox
    from sandbox.result import EvalConfig
    from sandbox.tasks import read_spec

    os.environ["KERNELLOOP_CACHE"] = cache      # the precompiled headers the steps above made
    spec = read_spec(BUILTIN_TASK)
    out = []
    with Sandbox(device, EvalConfig(build_timeout_s=900.0), build_slots=1, arch=arch,
                 warm_workers=1 if warm else 0) as sb:
        for _ in range(n):
            pool = sb._build_pool
            if pool is not None:
                pool.prime(0)
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline and not all(w.done.is_set() for w in pool._idle.get(0, [])):
                    time.sleep(0.1)
            salt = uuid.uuid4().hex[:12]
            if style == "builtin":
                src = builtin_source(device, salt)
            else:
                cpp, cuda = ((CPP_LEAN, KERNEL_LEAN) if style == "lean" else (CPP_TORCH, KERNEL_TORCH)) \
                    if device == "cuda" else (CPU_SRC, None)
                src = ("import torch\nfrom torch.utils.cpp_extension import load_inline\n"
                       f"_ext = load_inline(name={'bench_' + salt!r}, cpp_sources=[{cpp.replace('SALT', salt)!r}], "
                       + (f"cuda_sources=[{cuda.replace('SALT', salt)!r}], " if cuda else "")
                       + "functions=['scale_add'])\n")
            check = sb.build_only(spec, src)
            if not check.ok:
                raise SystemExit(f"worker build ({style}) failed: {check.error_message}\n"
                                 f"{check.build.log[-3000:] if check.build else ''}")
            out.append(check.build.seconds)
    return out


def _headers_taken(runs: list[dict]) -> dict:
    """The precompiled headers the last steady-state build's C++ file takes, and any GCC skipped."""
    from sandbox.pch import headers_used

    for d in reversed([d for r in runs for d in r["dirs"]]):
        if (Path(d) / "main.cpp").exists():
            found = headers_used(Path(d))
            return {"used": [Path(g).name for g in found["used"]], "skipped": found["skipped"]}
    return {"used": [], "skipped": []}


def _steps(runs: list[dict]) -> str:
    names = sorted({k for r in runs for k in r["steps"]}, key=lambda k: (k == "link", k))
    return ", ".join(f"{k} {statistics.median(r['steps'].get(k, 0.0) for r in runs):.1f} s" for k in names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--styles", default="lean,torch,builtin",
                    help="lean, torch, builtin (cuda); cpp, builtin (cpu)")
    ap.add_argument("--workers", action="store_true",
                    help="also time the whole build stage (Sandbox.build_only) with a cold and a warm build worker")
    ap.add_argument("--parallel", type=int, default=1,
                    help="builds at once (each in its own process; plain and sandbox alike): on a host with many "
                         "cores this shortens the benchmark, not the builds")
    ap.add_argument("--bindings", default="raw",
                    help="the C++ file's bindings, each timed after the other on the same sources: raw (the CPython "
                         "API and kernelloop's glue, sandbox.pyglue: the default) and/or pybind (pybind11's, as "
                         "KERNELLOOP_RAW_BINDING=0 builds them), e.g. raw,pybind")
    ap.add_argument("--arch", default=None,
                    help="CUDA arch for both modes (e.g. 9.0): build CUDA candidates on a host with nvcc but no GPU, "
                         "as plain load_inline would on that GPU")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kl-bench-build-")
    allowed = ("lean", "torch", "builtin") if args.device == "cuda" else ("cpp", "builtin")
    styles = [s for s in args.styles.split(",") if s in allowed] or (["cpp"] if args.device == "cpu" else ["lean"])
    from sandbox.slots import usable_cores

    print(f"{usable_cores()} cores; {args.parallel} build(s) at once; "
          f"KERNELLOOP_BUILD_JOBS={os.environ.get('KERNELLOOP_BUILD_JOBS', '4')}; arch {args.arch or 'of the GPU'}",
          flush=True)
    rows = []
    def batch(mode: str, style: str) -> list[dict]:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            return list(pool.map(lambda _: build_once(mode, style, args.device, cache, args.arch), range(args.n)))

    bindings = [b for b in args.bindings.split(",") if b in ("raw", "pybind")] or ["raw"]
    for style, binding in [(s, b) for s in styles for b in bindings]:
        os.environ["KERNELLOOP_RAW_BINDING"] = "1" if binding == "raw" else "0"    # read by each build's process
        plain = batch("plain", style) if binding == bindings[0] else plain
        # The first sandbox build also makes the precompiled headers (once per torch install and flags).
        first = build_once("sandbox", style, args.device, cache, args.arch)
        # the second makes the precompiled header of the C++ file's leading includes, where there are
        # more than the binding header's (made from the second time a block is seen: sandbox.pch.seen_before)
        second = build_once("sandbox", style, args.device, cache, args.arch)
        ours = batch("sandbox", style)
        p, o = statistics.median(r["seconds"] for r in plain), statistics.median(r["seconds"] for r in ours)
        row = {"style": style, "binding": binding, "plain_median_s": round(p, 2),
               "sandbox_first_s": round(first["seconds"], 2),
               "sandbox_second_s": round(second["seconds"], 2),
               "sandbox_median_s": round(o, 2), "ratio": round(p / o, 2),
               "sandbox_steps_median_s": {k: round(statistics.median(r["steps"].get(k, 0.0) for r in ours), 2)
                                          for k in sorted({k for r in ours for k in r["steps"]})}}
        print(f"[{args.device}/{style}, {binding} binding] plain load_inline median {p:.1f} s {['%.1f' % r['seconds'] for r in plain]} "
              f"({_steps(plain) or 'steps not logged'})\n"
              f"  sandbox first (makes the PCH) {first['seconds']:.1f} s ({_steps([first])}); second (makes the "
              f"leading-include PCH, if any) {second['seconds']:.1f} s ({_steps([second])})\n"
              f"  sandbox, PCHs made: median {o:.1f} s {['%.1f' % r['seconds'] for r in ours]} ({_steps(ours)})\n"
              f"  ratio plain/sandbox {p / o:.2f}x", flush=True)
        taken = _headers_taken(ours)
        row["pch_used"], row["pch_skipped"] = taken["used"], taken["skipped"]
        print(f"  the C++ file's precompiled headers (sandbox.pch.headers_used): {len(taken['used'])} taken "
              f"{taken['used']}" + (f"; SKIPPED {taken['skipped']}" if taken["skipped"] else ""), flush=True)
        if args.workers:
            cold = worker_builds(style, args.device, cache, args.arch, args.n, warm=False)
            warm = worker_builds(style, args.device, cache, args.arch, args.n, warm=True)
            row.update(worker_cold_median_s=round(statistics.median(cold), 2),
                       worker_warm_median_s=round(statistics.median(warm), 2))
            print(f"  build stage (Sandbox.build_only): worker cold median {statistics.median(cold):.1f} s "
                  f"{['%.1f' % x for x in cold]}; worker warm median {statistics.median(warm):.1f} s "
                  f"{['%.1f' % x for x in warm]}", flush=True)
        rows.append(row)
    print(json.dumps({"device": args.device, "cores": usable_cores(), "parallel": args.parallel, "results": rows}))


if __name__ == "__main__":
    main()
