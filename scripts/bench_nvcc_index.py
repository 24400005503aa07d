"""nvcc's time for the builtin's kernels with 32-bit indices only against both index types, or with only
the norm and reduction kernels the task's sizes pick against all of them (``--against static``; issue #36).

Every CUDA kernel of the builtin was compiled for ``int`` and ``long long`` indices; at KernelBench's
level-2 and level-3 sizes the second never runs (``agent.builtin.kernels.narrow_indices_on``). For each
task this renders the default candidate both ways (``KERNELLOOP_CUDA_NARROW_INDEX=1`` / ``=0``) and
compiles its device code (``_CUDA_SOURCE``: it includes only cuda_runtime.h, so no CUDA build of torch is
needed) with ``nvcc -O3`` for one architecture, the two variants alternated ``--repeats`` times, and
prints the median seconds of each (wall, and nvcc's CPU seconds) and their ratio. ``--against static``
renders the default candidate with ``KERNELLOOP_CUDA_STATIC_VARIANTS=1`` / ``=0`` instead
(``KernelGroup.reach``; 32-bit indices on both ways). The sandbox's build also compiles the host glue
(``docs/builds.md``); this times the device code only.

    python3 scripts/bench_nvcc_index.py --kb ../shared/KernelBench --tasks 12,17,23,35,57,91 --repeats 2
    python3 scripts/bench_nvcc_index.py --against static --tasks 17,23,33,99 --repeats 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _device_code(spec, env: str, value: str) -> str:
    from agent.builtin import generate
    from agent.builtin.codegen import cuda_source_of

    os.environ[env] = value
    try:
        return cuda_source_of(generate(spec, "cuda").source)
    finally:
        os.environ.pop(env, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", default=str(ROOT.parent / "shared" / "KernelBench"), help="a KernelBench copy")
    ap.add_argument("--level", default="level2")
    ap.add_argument("--tasks", default="12,17,23,35,57,91", help="task numbers, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--against", choices=["narrow", "static"], default="narrow",
                    help="narrow: 32-bit indices only vs both; static: the kernels the sizes pick vs all")
    args = ap.parse_args()
    from agent.builtin.kernels import NARROW_ENV, STATIC_VARIANTS_ENV

    env = NARROW_ENV if args.against == "narrow" else STATIC_VARIANTS_ENV
    label = {"narrow": ("32-bit only", "both index types"), "static": ("kernels the sizes pick", "every kernel")}[args.against]
    from sandbox.tasks import read_spec

    nvcc = str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    if not Path(nvcc).exists():
        nvcc = shutil.which("nvcc") or ""
    if not nvcc:
        ap.error("needs nvcc (CUDA_HOME/bin/nvcc or on PATH)")
    numbers = {n.strip() for n in args.tasks.split(",") if n.strip()}
    paths = sorted(p for p in (Path(args.kb) / args.level).glob("*.py") if p.stem.split("_")[0] in numbers)
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            spec = read_spec(path, {}, name=f"{args.level}/{path.stem}")
            codes = {"narrow": _device_code(spec, env, "1"), "both": _device_code(spec, env, "0")}
            if not codes["narrow"]:
                print(f"{spec.name}: no CUDA kernels")
                continue
            seconds: dict[str, list[float]] = {"narrow": [], "both": []}
            cpu: dict[str, list[float]] = {"narrow": [], "both": []}
            for i in range(args.repeats):
                for kind in (("narrow", "both") if i % 2 == 0 else ("both", "narrow")):
                    cu = Path(tmp) / f"{kind}.cu"
                    cu.write_text(codes[kind])
                    t0, c0 = time.perf_counter(), os.times()
                    done = subprocess.run([nvcc, "-O3", f"-arch={args.arch}", "-std=c++17", "-c", str(cu),
                                           "-o", str(cu.with_suffix(".o"))], capture_output=True, text=True)
                    if done.returncode != 0:
                        print(f"{spec.name} {kind}: nvcc failed\n{done.stderr[-2000:]}")
                        return 1
                    seconds[kind].append(time.perf_counter() - t0)
                    c1 = os.times()
                    cpu[kind].append(c1.children_user + c1.children_system - c0.children_user - c0.children_system)
            n, b = statistics.median(seconds["narrow"]), statistics.median(seconds["both"])
            ratios.append(n / b)
            dropped = (f"{codes['both'].count('<long long><<<')} 64-bit launches dropped" if args.against == "narrow"
                       else f"{codes['both'].count('__global__') - codes['narrow'].count('__global__')} kernels left out")
            print(f"{spec.name}: {label[0]} {n:.2f} s (CPU {statistics.median(cpu['narrow']):.2f} s), {label[1]} "
                  f"{b:.2f} s (CPU {statistics.median(cpu['both']):.2f} s): {n / b:.2f}x ({dropped})", flush=True)
    if ratios:
        print(f"geomean over {len(ratios)} tasks: {statistics.geometric_mean(ratios):.2f}x nvcc's time "
              f"(device code, -O3, {args.arch}, {os.cpu_count()} cores here)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
