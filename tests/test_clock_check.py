"""The parent's clock against a worker's reported times (sandbox/clock_check.py): a worker that lied
about its runs is `suspicious`; on cpu, one that waited for a core on a loaded host is `contended`."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sandbox.clock_check import Spent, clock_check
from sandbox.result import EvalResult, FlagKind, Status, Timing


def _timed(mean_ms: float, runs: int = 5) -> Timing:
    return Timing(median_ms=mean_ms, iqr_ms=0.0, mean_ms=mean_ms, min_ms=mean_ms, max_ms=mean_ms, runs=runs,
                  clock="perf_counter")


def _result(device: str, cand_ms: float = 10.0, eager_ms: float = 20.0) -> EvalResult:
    return EvalResult(status=Status.correct, task="t", device=device, candidate_time=_timed(cand_ms),
                      eager_time=_timed(eager_ms))


def _spent(wall: float, cpu: float | None) -> Spent:
    s = Spent(None)
    s.wall, s.cpu = wall, cpu
    return s


def _flags(r: EvalResult) -> list[str]:
    return [f.kind.value for f in r.flags]


# the reference: 5 runs of 20 ms reported, 0.15 s seen (50 ms of warm-ups and messages), as much CPU
REF = (0.15, 0.15)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_reported_times_the_parents_clock_explains_pass(device):
    r = _result(device)
    clock_check(r, _spent(*REF), _spent(0.05 + 0.05 + 0.2, 0.1), device)     # 0.2 s over: under the slack
    assert r.flags == []


def test_a_worker_that_computed_for_the_time_it_did_not_report_is_suspicious_on_cpu():
    r = _result("cpu")
    clock_check(r, _spent(*REF), _spent(0.9, 0.88), "cpu")
    assert _flags(r) == ["suspicious"]
    assert "saw 900.0 ms for 5 timed runs the worker reported as 50.0 ms" in r.flags[0].reason
    assert "used 880.0 ms of CPU" in r.flags[0].reason
    assert not r.clean


def test_a_worker_that_waited_for_a_core_is_contended_not_suspicious_on_cpu():
    # session ad's CI: an honest Triton candidate's 5 runs reported as 50.5 ms, 901 ms on the parent's clock
    r = _result("cpu")
    clock_check(r, _spent(*REF), _spent(0.901, 0.11), "cpu")
    assert _flags(r) == ["contended"]
    assert "used only 110.0 ms of CPU" in r.flags[0].reason and "waited for a core" in r.flags[0].reason
    assert not r.clean and not r.has_flag(FlagKind.suspicious)


def test_the_reference_also_waiting_is_allowed_for():
    # both workers waited alike: the reference's own unexplained wall time is allowed the candidate
    r = _result("cpu")
    clock_check(r, _spent(1.0, 0.15), _spent(0.95, 0.1), "cpu")
    assert r.flags == []


def test_cuda_keeps_the_wall_clock_rule_whatever_the_cpu_time():
    r = _result("cuda")
    clock_check(r, _spent(*REF), _spent(0.901, 0.11), "cuda")
    assert _flags(r) == ["suspicious"]


def test_on_cuda_a_window_whose_allocator_retried_is_contended_not_suspicious():
    """Session af: level2/100's channels-last candidate (4.8 ms runs, 1.8x compile) was flagged
    suspicious twice, the parent's clock seeing about 615 ms for runs reported as 95 ms, its own timing
    thread 589 ms. Failed allocations retried over the window (the GPU's memory short: the harness's
    condition) make it contended; without retries the wall-clock rule stands."""
    r = _result("cuda")
    r.candidate_time.alloc_retries = 3
    clock_check(r, _spent(*REF), _spent(0.901, None), "cuda")
    assert _flags(r) == ["contended"] and "retried 3 time(s)" in r.flags[0].reason and not r.clean
    r = _result("cuda")
    r.candidate_time.alloc_retries, r.candidate_time.device_allocs = 0, 12
    clock_check(r, _spent(*REF), _spent(0.901, None), "cuda")
    assert _flags(r) == ["suspicious"]


def test_the_timing_counts_the_allocators_driver_allocations_and_retries_on_cuda_only(monkeypatch):
    import torch

    from sandbox import timing

    counts = iter([{"num_device_alloc": 5, "num_alloc_retries": 1}, {"num_device_alloc": 9, "num_alloc_retries": 3}])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: next(counts))
    assert timing.allocator_counts("cuda") == (5, 1) and timing.allocator_counts("cuda") == (9, 3)
    assert timing.allocator_counts("cpu") is None
    t = timing.time_runs(lambda x: x + 1, lambda i: (torch.ones(4),), "cpu", warmup=1, runs=3)
    assert t.device_allocs is None and t.alloc_retries is None


def test_no_cpu_figure_keeps_the_wall_clock_rule():
    r = _result("cpu")
    clock_check(r, _spent(*REF), _spent(0.901, None), "cpu")
    assert _flags(r) == ["suspicious"]


def test_spent_counts_the_cpu_a_worker_used_and_not_the_time_it_waited():
    busy = subprocess.Popen([sys.executable, "-c", "import sys\nwhile sys.stdin.readline():\n"
                             "    t = 0\n    for i in range(3_000_000): t += i\n    print(t, flush=True)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import sys\nwhile sys.stdin.readline():\n    print(1, flush=True)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        burn, wait = Spent(busy.pid), Spent(idle.pid)
        with burn.during():
            busy.stdin.write("go\n")
            busy.stdin.flush()
            busy.stdout.readline()
        with wait.during():
            time.sleep(0.3)                          # the parent's clock runs; the worker waits
            idle.stdin.write("go\n")
            idle.stdin.flush()
            idle.stdout.readline()
        assert burn.cpu is not None and wait.cpu is not None
        assert burn.cpu > 0.1 and burn.wall >= burn.cpu * 0.9       # the loop's CPU, however long it waited
        assert wait.wall >= 0.3 and wait.cpu < 0.1
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
