"""The built-in proposer's CPU candidates against eager on the seed tasks, side by side.

For each seed task at its CPU sizes: the builtin's first candidate (or a candidate file given
with ``--source task=path``), then eager and the candidate timed alternately (``--pairs``
times), each with ``sandbox.timing.time_runs`` (the judge's CPU policy: fresh inputs, cache
flushed before every run) and one intra-op thread, as ``kernelloop optimize --device cpu`` times
them. Prints each side's median of medians and the ratio eager / candidate (> 1: faster).
The machine may be shared: the ratio of alternated runs is the figure to read, not the times.

    python scripts/bench_cpu_seeds.py [--tasks a,b] [--pairs 5] [--source gemm_x=/tmp/c.py]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.builtin import generate  # noqa: E402
from sandbox.harness import make_inputs, make_model  # noqa: E402
from sandbox.tasks import exec_source, load_task, read_spec, with_device_sizes  # noqa: E402
from sandbox.timing import time_runs  # noqa: E402

SEEDS = ["conv2d_bias_scale_sigmoid_groupnorm", "conv2d_divide_leakyrelu", "gemm_groupnorm_leakyrelu_sum",
         "gemm_logsumexp_leakyrelu_gelu", "gemm_sigmoid_gemm_logsumexp"]


def bench(name: str, source: str, pairs: int, runs: int) -> tuple[float, float, float]:
    spec = with_device_sizes(read_spec(ROOT / "tasks" / "seeds" / f"{name}.py"), "cpu")
    task = load_task(spec)
    ns = exec_source(source, f"{name}_candidate.py")
    ref = make_model(task.Model, task, 0, "cpu").eval()
    new = make_model(ns["ModelNew"], task, 0, "cpu").eval()
    with torch.no_grad():
        x = make_inputs(task, 1, "cpu")
        err = (new(*x) - ref(*x)).abs().max().item()
    eager, cand = [], []
    for _ in range(pairs):
        eager.append(time_runs(ref, lambda i: make_inputs(task, 100 + i, "cpu"), "cpu", runs=runs).median_ms)
        cand.append(time_runs(new, lambda i: make_inputs(task, 100 + i, "cpu"), "cpu", runs=runs).median_ms)
    return statistics.median(eager), statistics.median(cand), err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=",".join(SEEDS))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--source", action="append", default=[], help="task=path of a candidate to time instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    given = dict(s.split("=", 1) for s in args.source)
    print(f"timing on cpu: eager and candidate with {torch.get_num_threads()} intra-op thread(s) each, "
          f"alternated {args.pairs} times x {args.runs} runs (sandbox.timing.time_runs); median ms")
    for name in args.tasks.split(","):
        source = Path(given[name]).read_text() if name in given else generate(
            read_spec(ROOT / "tasks" / "seeds" / f"{name}.py"), "cpu").source
        e, c, err = bench(name, source, args.pairs, args.runs)
        print(f"{name:40s} eager {e:8.4f}  candidate {c:8.4f}  speedup {e / c:5.2f}x  max|diff| {err:.2e}",
              flush=True)


if __name__ == "__main__":
    main()
