"""Throughput: distinct candidates evaluated per minute through one Sandbox (builds in
parallel on the CPU cores while the device checks and times others), as the loop uses it.

    python scripts/bench_throughput.py --device cuda --candidates 40 --kernels 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandbox.evaluate import Sandbox  # noqa: E402
from sandbox.slots import usable_cores  # noqa: E402
from sandbox.result import EvalConfig  # noqa: E402
from sandbox.tasks import read_spec  # noqa: E402

TASK = ROOT / "tests" / "adversarial" / "task_small.py"


def candidate(device: str, kernel: int, variant: int, salt: str) -> str:
    src = (ROOT / "tests" / "adversarial" / device / "honest.py").read_text()
    # A distinct kernel per `kernel` (a new build), a distinct candidate per `variant` (same build).
    marker = "(v > 0.f ? v : 0.f)" if device == "cuda" else "(p[i] > 0.f ? p[i] : 0.f)"
    src = src.replace(marker, f"{marker} /* k{kernel}-{salt} */")
    return src + f"\n# variant {variant}\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--candidates", type=int, default=40)
    ap.add_argument("--kernels", type=int, default=10)
    ap.add_argument("--parallel", type=int, default=None)
    args = ap.parse_args()
    salt = os.urandom(4).hex()
    spec = read_spec(TASK, name="bench/task_small")
    cfg = EvalConfig(trials=5, timed_runs=20, warmup_runs=3, time_compile=False, profile=True)
    cands = [candidate(args.device, i % args.kernels, i, salt) for i in range(args.candidates)]
    with Sandbox(args.device, cfg) as sb:
        sb.evaluate(spec, candidate(args.device, -1, -1, salt))     # start the reference (not counted)
        t0 = time.monotonic()
        workers = args.parallel or max(4, usable_cores() // 2)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda s: sb.evaluate(spec, s), cands))
        wall = time.monotonic() - t0
    ok = sum(r.correct for r in results)
    builds = sum(1 for r in results if r.build and not r.build.cached)
    rate = len(results) / wall * 60
    print(f"{len(results)} candidates ({args.kernels} distinct kernels, {builds} uncached builds) in {wall:.1f} s: "
          f"{rate:.1f} candidates/min, {ok} correct, {usable_cores()} cores (goal >= 30/min)")
    # where an evaluation's time goes (median seconds per phase; the device is held for trials,
    # timing, spot checks, profile and floor, one candidate at a time)
    names = sorted({k for r in results for k in r.phases})
    phases = {k: round(statistics.median(r.phases.get(k, 0.0) for r in results), 3) for k in names}
    held = ("trials", "timing", "spot_checks", "profile", "floor")
    device_s = sum(sum(r.phases.get(k, 0.0) for k in held) for r in results)
    print("median phase seconds: " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    print(f"device held {device_s:.1f} s of {wall:.1f} s wall ({device_s / len(results):.2f} s per candidate)")
    print(json.dumps({"candidates": len(results), "wall_s": wall, "per_min": rate, "correct": ok,
                      "phases_median_s": phases, "device_held_s": device_s}))


if __name__ == "__main__":
    main()
