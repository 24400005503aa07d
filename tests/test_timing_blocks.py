"""cpu's interleaved timing blocks (``sandbox.checks.CandidateChecks._time_in_blocks``, docs/judge.md
"A/A"): on the CPU target the candidate's and the reference's timed runs go in short blocks,
interleaved, the order alternating (ABBA), so the host's drift between blocks falls on both sides;
every timed run is still sampled and checked; cuda keeps its one-block sequence. These tests drive
``CandidateChecks.run`` with fake workers that record every request: they assert the sequence, not
a timing, so they hold on any host."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from sandbox.blocks import block_plan
from sandbox.checks import BLOCK_WARMUP, CandidateChecks, block_timing
from sandbox.phases import Stages
from sandbox.result import EvalConfig, EvalResult, Status, Timing


def _timing(runs: int, ms: float = 1.0) -> dict[str, Any]:
    return Timing(median_ms=ms, iqr_ms=0.0, mean_ms=ms, min_ms=ms, max_ms=ms, runs=runs, clock="perf_counter",
                  samples_ms=[ms] * runs, page_faults=0.0).model_dump()


class FakeCandidate:
    worker_pid = None           # IdleWatch watches nothing

    def __init__(self, log: list):
        self.log, self.kept, self.first_block_runs = log, [], None

    def sweep(self) -> list[str]:
        self.log.append(("candidate", "sweep", {}))
        return []

    def ask(self, payload: dict[str, Any], timeout: float = 0.0) -> dict[str, Any]:
        op = payload["op"]
        self.log.append(("candidate", op, dict(payload)))
        if op == "trial":
            return {"ok": True, "outputs": {"name": "t"}, "custom_calls": 1, "output_bytes": 4}
        if op == "time":
            self.kept = list(payload.get("check_runs", []))
            return {"ok": True, "timing": _timing(int(payload["runs"]), 1.0), "tampered": [], "threads_started": 0}
        if op == "timed_outputs":
            first = int(payload.get("first") or 0)
            saved = {str(first + i): {"name": f"candidate_timed_{first + i}.pt"} for i in self.kept}
            self.kept = []
            return {"ok": True, "saved": saved, "samples_path": f"/tmp/samples_{len(self.log)}.pt"}
        raise AssertionError(op)


class FakeReference:
    proc = None
    profile = counts = None

    def __init__(self, log: list, fail: dict | None = None):
        """``fail``: {block's first run: [local runs whose samples fail]}"""
        self.log, self.lock, self.fail, self.seed0 = log, threading.Lock(), fail or {}, None

    def ask(self, payload: dict[str, Any], timeout: float = 0.0) -> dict[str, Any]:
        op = payload["op"]
        self.log.append(("compile" if payload.get("compiled") else "reference", op, dict(payload)))
        if op == "trial":
            return {"ok": True, "output_bytes": 4}
        if op == "compare":
            return {"ok": True, "passed": True, "checks": []}
        if op == "time":
            self.seed0 = payload["seed"] if self.seed0 is None else self.seed0
            reply = {"ok": True, "timing": _timing(int(payload["runs"]), 1.0)}
            if payload.get("samples_path"):
                reply["samples"] = self._verdict(payload)
            return reply
        if op == "check_samples":
            return {"ok": True, "samples": self._verdict(payload)}
        raise RuntimeError(f"not faked: {op}")      # roofline: the floor is optional evidence

    def _verdict(self, payload: dict[str, Any]) -> dict[str, Any]:
        failed = [[i, "stale"] for i in self.fail.get(int(payload["seed"]) - self.seed0, [])]
        return {"checked": int(payload["runs"]) - len(failed), "failed": failed}


def _evaluate(device: str, blocks: int, config: EvalConfig | None = None, fail: dict | None = None):
    cfg = config or EvalConfig(profile=False)
    log: list = []
    cand, ref = FakeCandidate(log), FakeReference(log, fail)
    result = EvalResult(status=Status.runtime_error, task="t", device=device)
    checks = CandidateChecks(cfg, device, None, None, False, blocks)
    stages = Stages(result)
    checks.run(result, ref, cand, stages)
    stages.enter(None)
    timing_seed = next(p["seed"] for who, op, p in log if op == "time")
    timed = [(who, p) for who, op, p in log if op == "time"]
    return result, log, timed, timing_seed


def test_block_plan_splits_the_runs_evenly_and_keeps_their_numbers():
    assert block_plan(20, 4) == [(0, 5), (5, 5), (10, 5), (15, 5)]
    assert block_plan(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert block_plan(3, 10) == [(0, 1), (1, 1), (2, 1)]
    assert block_plan(20, 1) == [(0, 20)]


def test_on_cpu_the_sides_time_in_interleaved_blocks_that_alternate_which_goes_first():
    result, log, timed, seed = _evaluate("cpu", 4)
    assert result.status is Status.correct, result.error_message
    sides = [who for who, _ in timed]
    c, e, k = "candidate", "reference", "compile"
    assert sides == [c, e, k, k, e, c, c, e, k, k, e, c]         # ABBA, compile between its ends
    # every side covers the evaluation's runs once, block by block, at the same seeds
    for side in (c, e, k):
        asks = [p for who, p in timed if who == side]
        assert [(p["seed"] - seed, p["runs"]) for p in asks] == block_plan(20, 4)
        assert sum(p["runs"] for p in asks) == 20
        assert [p["warmup"] for p in asks] == [3] + [BLOCK_WARMUP] * 3
        # warm-up inputs never come from a timed run's seed (a candidate could keep their outputs)
        warm = {p["warmup_seed"] + j for p in asks for j in range(p["warmup"])}
        assert not warm & set(range(seed, seed + 20))
    assert result.candidate_time.runs == result.eager_time.runs == result.compile_time.runs == 20
    assert result.candidate_time.blocks == result.eager_time.blocks == result.compile_time.blocks == 4
    assert len(result.candidate_time.samples_ms) == 20
    assert "4 blocks interleaved" in result.candidate_time.convention


def test_on_cpu_every_timed_run_is_still_checked():
    result, log, timed, seed = _evaluate("cpu", 4)
    assert result.timed_runs_checked == 20
    checked_inline = [(p["seed"] - seed, p["runs"]) for who, op, p in log
                      if who == "reference" and op == "time" and p.get("samples_path")]
    rerun = [(p["seed"] - seed, p["runs"]) for who, op, p in log if op == "check_samples"]
    assert checked_inline == [(0, 5), (10, 5)]          # the candidate's block went first: checked while timed
    assert rerun == [(5, 5), (15, 5)]                   # the reference's went first: rerun untimed, after it
    assert sorted(checked_inline + rerun) == block_plan(20, 4)
    # each check of a reference-first block follows that block's candidate run and hand-over
    for i, (who, op, p) in enumerate(log):
        if op == "check_samples":
            assert [entry[1] for entry in log[i - 3:i]] == ["time", "timed_outputs", "sweep"]
            assert log[i - 3][0] == "candidate" and log[i - 3][2]["seed"] == p["seed"]
    # spot checks: their runs kept in their blocks (local numbers there), compared at their own seeds
    cand_times = [p for who, p in timed if who == "candidate"]
    spots = sorted(off + j for p, (off, _) in zip(cand_times, block_plan(20, 4)) for j in p["check_runs"])
    assert 19 in spots
    spot_trials = [p["seed"] - seed for who, op, p in log if who == "reference" and op == "trial" and p["index"] >= 1000]
    assert spot_trials == spots
    # the candidate's strays swept before its first block and after every block of it
    assert sum(1 for who, op, _ in log if op == "sweep") == 1 + 4


def test_a_failed_sample_in_a_reference_first_block_names_the_evaluations_run():
    result, log, timed, seed = _evaluate("cpu", 4, fail={5: [2]})      # block 1 (runs 5-9), its third run
    assert result.status is Status.incorrect
    assert "timed run 7" in result.error_message and result.speedup_eager is None


def test_one_block_on_cpu_and_cuda_at_any_setting_keep_the_one_block_sequence():
    for device, blocks in (("cuda", 4), ("cuda", 1), ("cpu", 1)):
        result, log, timed, seed = _evaluate(device, blocks)
        assert result.status is Status.correct, (device, result.error_message)
        ops = [(who, op) for who, op, _ in log if op in ("time", "timed_outputs", "check_samples", "sweep")]
        assert ops == [("candidate", "sweep"), ("candidate", "time"), ("candidate", "timed_outputs"),
                       ("candidate", "sweep"), ("reference", "time"), ("compile", "time")], device
        cand = timed[0][1]
        assert cand["runs"] == 20 and cand["warmup"] == 3 and "warmup_seed" not in cand and cand["sample"]
        assert timed[1][1]["samples_path"] and timed[1][1]["seed"] == seed
        assert "first" not in next(p for _, op, p in log if op == "timed_outputs")
        assert result.candidate_time.blocks is None and result.timed_runs_checked == 20


def test_without_compile_the_blocks_alternate_candidate_and_eager():
    result, log, timed, seed = _evaluate("cpu", 4, EvalConfig(profile=False, time_compile=False))
    assert [who for who, _ in timed] == ["candidate", "reference", "reference", "candidate"] * 2
    assert result.compile_time is None and result.timed_runs_checked == 20


def test_block_timing_is_the_median_over_all_runs():
    blocks = [Timing(**{**_timing(2), "samples_ms": [1.0, 2.0], "page_faults": 0.0}),
              Timing(**{**_timing(2), "samples_ms": [3.0, 10.0], "page_faults": 2.0})]
    t = block_timing(blocks)
    assert t.runs == 4 and t.blocks == 2 and t.median_ms == pytest.approx(2.5)
    assert t.samples_ms == [1.0, 2.0, 3.0, 10.0] and t.page_faults == 1.0


def test_a_bad_block_count_names_the_setting(monkeypatch):
    from sandbox.slots import CPU_BLOCKS_ENV, cpu_timing_blocks, cpu_timing_note

    monkeypatch.setenv(CPU_BLOCKS_ENV, "0")
    with pytest.raises(ValueError, match=CPU_BLOCKS_ENV):
        cpu_timing_blocks()
    monkeypatch.setenv(CPU_BLOCKS_ENV, "6")
    assert cpu_timing_blocks() == 6 and "6 interleaved blocks" in cpu_timing_note()


def test_the_report_header_says_how_the_times_were_taken():
    from types import SimpleNamespace

    from evals.report import timing_conventions

    blocks = block_timing([Timing(**_timing(5))] * 4).convention
    one = Timing(**_timing(20)).convention
    assert timing_conventions([SimpleNamespace(timing=blocks)] * 3) == f"each side's time the {blocks}"
    mixed = timing_conventions([SimpleNamespace(timing=blocks), SimpleNamespace(timing=one), SimpleNamespace(timing=None)])
    assert "several conventions" in mixed and "4 blocks interleaved" in mixed and "in one block" in mixed


def test_a_burst_that_takes_one_sides_block_is_contended():
    """session q's seed read 4.11x: two of four eager blocks at 5.7-6.1 ms, the others 1.15-1.17 ms,
    the candidate's steady. Drift both sides meet (the A/A check's blocks) is not flagged."""
    from sandbox.blocks import block_burst
    from sandbox.result import Timing

    def t(ms: float) -> Timing:
        return Timing(median_ms=ms, iqr_ms=0.0, mean_ms=ms, min_ms=ms, max_ms=ms, runs=5, clock="perf_counter")

    cand = [t(1.4), t(1.35), t(1.42), t(1.38)]
    why = block_burst(cand, [t(6.1), t(1.15), t(5.7), t(1.17)])
    assert why and "burst" in why and "6.1" in why and "without block" in why
    assert block_burst(cand, [t(1.5), t(1.3), t(1.6), t(1.4)]) is None
    drift = [t(0.30), t(0.62), t(0.45), t(0.31)]         # the host's drift, on both sides
    assert block_burst(drift, [t(x * 1.02) for x in (0.31, 0.60, 0.47, 0.30)]) is None
    assert block_burst([t(1.0)], [t(9.0)]) is None       # one block: nothing to compare


def test_a_burst_the_median_absorbs_is_not_contended():
    """The CI host's case (a llama.cpp server beside the suite): one candidate block at 4.49 ms
    against 1.29-1.40 ms. The blocks' ratios spread 0.35-1.10, but the speedup is 1.00x with or
    without that block, so the burst did not reach the figure; the same burst in two blocks does."""
    from sandbox.blocks import block_burst, block_runs, leave_one_out
    from sandbox.result import Timing

    def t(ms: float) -> Timing:
        return Timing(median_ms=ms, iqr_ms=0.0, mean_ms=ms, min_ms=ms, max_ms=ms, runs=5, clock="perf_counter")

    eager = [t(1.55), t(1.34), t(1.34), t(1.55)]
    assert block_burst([t(4.49), t(1.29), t(1.34), t(1.40)], eager) is None
    assert all(0.9 < r < 1.2 for r in leave_one_out([block_runs(t(ms)) for ms in (4.49, 1.29, 1.34, 1.40)],
                                                    [block_runs(b) for b in eager]))
    assert block_burst([t(4.49), t(1.29), t(4.6), t(1.40)], eager) is not None


def test_the_critic_may_quote_the_burst_flag():
    """The flag's figures (block medians, their ratios, the speedup without the block) are all
    derivable from the stored result's runs, so the critic's grounded text quoting the flag passes
    its figure check."""
    from agent.critic.figures import result_evidence
    from agent.critic.numbers import check_text
    from sandbox.blocks import block_burst
    from sandbox.checks import block_timing
    from sandbox.result import EvalResult, FlagKind, Status, Timing

    def blk(ms: float, jitter: float = 0.01) -> Timing:
        runs = [ms * (1 + jitter * k) for k in range(5)]
        return Timing(median_ms=runs[2], iqr_ms=0.0, mean_ms=ms, min_ms=runs[0], max_ms=runs[-1], runs=5,
                      clock="perf_counter", samples_ms=[float(f"{x:.6g}") for x in runs])

    cand = [blk(1.4), blk(1.35), blk(1.42), blk(1.38)]
    eager = [blk(6.1), blk(1.15), blk(5.7), blk(1.17)]
    why = block_burst(cand, eager)
    assert why
    result = EvalResult(status=Status.correct, task="t", device="cpu", candidate_time=block_timing(cand),
                        eager_time=block_timing(eager))
    result.speedup_eager = result.eager_time.median_ms / result.candidate_time.median_ms
    result.add_flag(FlagKind.contended, why)
    assert check_text(f"Flagged contended: {why}.", result_evidence(result, "attempt 1"), strict=True) == []
