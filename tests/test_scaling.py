"""How a host's cores and GPUs are shared out: builds at once and their jobs (``sandbox.slots.
build_plan``), and the per-GPU figures of the throughput benchmark (``scripts/bench_kernelbench.py``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sandbox.result import EvalResult, Status
from sandbox.slots import build_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.mark.parametrize("cores, asked, slots, jobs", [
    (2, None, 1, 2),        # this CI host: one build, both its translation units at once
    (3, None, 1, 3),
    (16, None, 4, 4),       # one H100 with 16 cores
    (64, None, 16, 4),      # four GPUs, 64 cores: four times the builds, not longer ninja queues
    (128, None, 32, 4),
    (16, 1, 1, 8),          # one build asked for: it may use up to 8 jobs
    (16, 2, 2, 8),
    (4, 8, 8, 2),           # more builds asked than cores: at least 2 jobs each, as asked
])
def test_builds_at_once_scale_with_the_cores(cores, asked, slots, jobs):
    assert build_plan(cores, asked) == (slots, jobs)


def test_build_slots_grow_in_proportion_to_the_cores():
    one_gpu, four_gpus = build_plan(16)[0], build_plan(64)[0]
    assert four_gpus == 4 * one_gpu


def _result(gpu, **phases) -> EvalResult:
    return EvalResult(status=Status.correct, task="t", device="cuda", gpu=gpu, phases=phases)


def test_the_benchmark_says_how_busy_each_gpu_was_and_what_its_candidates_waited_for():
    from bench_kernelbench import per_gpu, summarize

    results = [_result("0", build=4.0, build_wait=1.0, trials=3.0, timing=1.0),
               _result("0", build=6.0, build_wait=3.0, trials=2.0, timing=1.0, memory_wait=5.0),
               _result("1", build=5.0, reference=8.0, trials=1.0)]
    gpus = per_gpu(results, wall=20.0)
    assert set(gpus) == {"0", "1"}
    assert gpus["0"]["candidates"] == 2 and gpus["0"]["held_s"] == 7.0 and gpus["0"]["busy_fraction"] == 0.35
    assert gpus["1"]["busy_fraction"] == 0.05
    assert gpus["0"]["waited_s"] == {"build_wait": 4.0, "build": 10.0, "memory_wait": 5.0}
    assert gpus["0"]["waited_median_s"]["memory_wait"] == 2.5        # one of its two waited
    assert gpus["1"]["waited_s"] == {"build": 5.0, "reference": 8.0}
    summary = summarize("pipelined", results, [], 20.0, 2, {})
    assert summary["per_gpu"] == gpus
    assert summary["device_busy_fraction"] == round(8.0 / 40.0, 3)
