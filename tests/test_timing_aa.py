"""The CPU A/A bias (docs/judge.md, "A/A"): the task's own ``Model`` submitted as its candidate
read 0.82-0.94x on a 2-core host because the candidate's timed runs were sampled
(``sandbox.runcheck.Sampler``) into fresh small allocations kept between the forwards; the
candidate worker's next forward then ran on fresh heap pages and paid their first-touch page
faults on the clock (28 per timed run at a seed task's CPU sizes), which the reference never did.
These tests assert the mechanism (where samples live, the page faults of timed calls), not a
timing ratio, so they hold on a noisy CI host."""
from __future__ import annotations

from pathlib import Path

import torch

from sandbox.result import EvalConfig
from sandbox.runcheck import SAMPLE, SampleCheck, Sampler

ROOT = Path(__file__).resolve().parent.parent
SEED_TASK = ROOT / "tasks" / "seeds" / "conv2d_divide_leakyrelu.py"


def test_a_sampler_told_its_runs_keeps_every_later_run_in_its_first_runs_buffers():
    runs = 6
    outputs = {i: (torch.randn(3 * SAMPLE + 5), torch.randn(10)) for i in range(runs)}
    s = Sampler("cpu", runs=runs)
    s(0, outputs[0])
    storages = [[t.untyped_storage().data_ptr() for t in pair] for pair in s.runs[0]]
    for i in range(1, runs):
        s(i, outputs[i])
        # views of the buffers allocated at run 0: nothing kept was allocated between the forwards
        assert [[t.untyped_storage().data_ptr() for t in pair] for pair in s.runs[i]] == storages
        (pos, vals), (small_pos, small_vals) = s.runs[i]
        assert pos.numel() == SAMPLE and torch.equal(vals, outputs[i][0][pos])
        assert small_pos.tolist() == list(range(10)) and torch.equal(small_vals, outputs[i][1])
    first, second = s.runs[1][0][0].clone(), s.runs[2][0][0].clone()
    assert not torch.equal(first, second)                   # fresh secret positions per run still


def test_buffered_samples_are_checked_as_before_and_a_stale_run_still_fails(tmp_path):
    runs = 4
    refs = {i: torch.randn(5000) for i in range(runs)}
    cand = dict(refs)
    cand[2] = refs[1]                                       # run 2 returned run 1's output
    s = Sampler("cpu", runs=runs)
    for i in range(runs):
        s(i, cand[i])
    s(runs, torch.randn(5000))                              # beyond the runs told: kept on its own, not lost
    assert set(s.runs) == set(range(runs + 1))
    s.save(tmp_path / "s.pt", torch.save)
    assert (tmp_path / "s.pt").stat().st_size < 200_000     # each run's rows alone, not whole buffers per run
    cfg = EvalConfig()
    cfg = cfg.model_copy(update={"numerics": cfg.numerics.model_copy(update={"fp64_check": False})})
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", runs, cfg)
    for i in range(runs):
        check(i, refs[i])
    verdict = check.finish(worker=None)
    assert verdict["checked"] == runs - 1 and [i for i, _ in verdict["failed"]] == [2]


def test_a_layout_change_mid_timing_falls_back_to_allocations_of_its_own():
    s = Sampler("cpu", runs=3)
    s(0, torch.randn(4000))
    s(1, torch.randn(4000, dtype=torch.float64))            # another dtype than run 0's buffers hold
    s(2, (torch.randn(4000), torch.randn(7)))               # another output count
    assert s.runs[1][0][1].dtype == torch.float64 and len(s.runs[2]) == 2


def test_cpu_timing_records_page_faults_of_the_timed_calls():
    from sandbox.timing import time_runs

    import mmap

    keep: list[mmap.mmap] = []

    def fresh_pages() -> torch.Tensor:
        # touches 4 MiB of new memory on every call: an anonymous mapping of its own (malloc could
        # serve torch.ones from heap pages an earlier test freed, faulting nothing: flaky in the suite)
        mm = mmap.mmap(-1, 4 << 20)
        keep.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8).fill_(1)

    t = time_runs(fresh_pages, lambda i: (), "cpu", warmup=1, runs=5, flush_l2=False)
    assert t.page_faults is not None and t.page_faults >= 512     # 4 MiB / 4 KiB pages, at least half
    quiet = time_runs(lambda: None, lambda i: (), "cpu", warmup=1, runs=5, flush_l2=False)
    assert quiet.page_faults == 0


def test_an_aa_evaluation_times_the_candidate_on_no_more_fresh_pages_than_the_reference():
    """Through the real sandbox: the task's own Model as its candidate, its timed runs sampled.
    With the old sampler the candidate's timed calls faulted 14-28 pages each, the reference's none."""
    from sandbox.evaluate import Sandbox
    from sandbox.result import Status
    from sandbox.tasks import read_spec, with_device_sizes

    spec = with_device_sizes(read_spec(SEED_TASK, name="aa/conv2d_divide_leakyrelu"), "cpu")
    source = SEED_TASK.read_text() + "\n\nclass ModelNew(Model):\n    pass\n"
    with Sandbox("cpu", EvalConfig(time_compile=False, profile=False), build_slots=1) as sb:
        for _ in range(2):
            r = sb.evaluate(spec, source)
            assert r.status == Status.correct, r.error_message
            assert r.timed_runs_checked == r.candidate_time.runs          # every timed run still sampled
            # timed in interleaved blocks (tests/test_timing_blocks.py), the reference-first blocks'
            # samples checked by the reference's untimed reruns: all runs of both sides, all checked
            assert (r.candidate_time.blocks or 1) == (r.eager_time.blocks or 1) == sb.timing_blocks
            assert r.candidate_time.runs == r.eager_time.runs == len(r.candidate_time.samples_ms) == 20
            c, e = r.candidate_time.page_faults, r.eager_time.page_faults
            assert c is not None and e is not None
            assert c <= e + 4, f"the candidate's timed calls faulted {c} pages each, the reference's {e}"


def test_a_timing_records_the_timing_threads_window_and_its_cores_clock():
    """``Timing.host_*`` (the thread's CPU and wall time, its preemptions) and the clock of the core
    it ran on, read where Linux tells it; no SM clock off the GPU."""
    import sys

    from sandbox.timing import time_runs

    t = time_runs(lambda: sum(range(20000)), lambda i: (), "cpu", warmup=1, runs=5, flush_l2=False)
    assert t.host_wall_ms and t.host_cpu_ms and 0 < t.host_cpu_ms <= t.host_wall_ms * 1.05 + 1
    assert t.gpu_sm_mhz is None
    if sys.platform.startswith("linux"):
        assert t.host_cpu_mhz is not None and 100 < t.host_cpu_mhz < 10000, t.host_cpu_mhz
