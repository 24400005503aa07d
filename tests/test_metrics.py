"""Run metrics against hand-computed values (see tests/fixture_store.py for the table)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_store import EXPECTED_A, approx, build_fixture_store  # noqa: E402

from evals.metrics import (AttemptRecord, CallRecord, best_attempt, compute_metrics, fast_p,  # noqa: E402
                           geomean, median, task_metrics)
from evals.run_data import load_run  # noqa: E402


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    info = build_fixture_store(tmp_path_factory.mktemp("metrics"))
    with info.store.reader() as s:
        a = load_run(s, info.run_a)
        b = load_run(s, info.run_b)
    yield info, a, b
    info.store.close()


def rec(aid, task="t", rnd=0, status="correct", clean=True, se=None, sc=None, ms=None, flags=(), ff=None):
    return AttemptRecord(attempt_id=aid, task=task, round=rnd, status=status, clean=clean,
                         speedup_eager=se, speedup_compile=sc, candidate_ms=ms, flags=list(flags), floor_fraction=ff)


# ------------------------------------------------------------------------ the fixture store

@pytest.mark.parametrize("name", sorted(EXPECTED_A))
def test_run_a_matches_hand_computed(fixture, name):
    _, a, _ = fixture
    got = getattr(a.metrics, name)
    want = EXPECTED_A[name]
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert approx(got[k], want[k]), (name, k, got[k], want[k])
    elif isinstance(want, float):
        assert approx(got, want), (name, got, want)
    else:
        assert got == want


def test_hand_computed_numbers_spelled_out(fixture):
    """The same figures written as plain arithmetic, so a reader can check the fixture."""
    _, a, _ = fixture
    m = a.metrics
    assert m.correctness_rate == 0.75 == m.fast_p_eager["0"]          # matmul, relu, lse of 4
    assert m.fast_p_eager["0.8"] == 0.5                               # relu's 0.8x is not > 0.8
    assert m.fast_p_compile["0.5"] == 0.5                              # relu's 0.5x is not > 0.5
    assert m.fast_p_compile["2"] == 0.0                                # best vs compile is 1.875x
    assert math.isclose(m.geomean_speedup_eager, 2.4 ** (1 / 3))
    assert math.isclose(m.geomean_speedup_compile, 0.75 ** (1 / 3))
    assert math.isclose(m.attempt_correctness_rate, 4 / 9)
    assert math.isclose(m.tokens_per_correct_kernel, 18100 / 3)
    assert math.isclose(m.cost_per_correct_kernel, 0.13 / 3)


def test_flagged_correct_is_not_a_correct_kernel(fixture):
    _, a, _ = fixture
    cg = a.metrics.task("level2/conv_gn")
    assert not cg.correct and cg.flagged_only
    assert cg.flagged_attempts == 1 and cg.correct_attempts == 0
    assert cg.best is not None and cg.best.status == "correct" and cg.best.flags == ["fallback"]
    assert cg.speedup("eager") is None      # its 3.0x does not count anywhere
    assert a.metrics.flag_counts == {"fallback": 1, "precision": 1}
    # a precision flag alone does not disqualify
    lse = a.metrics.task("level2/lse")
    assert lse.correct and lse.best.flags == ["precision"]


def test_best_attempt_per_task(fixture):
    info, a, _ = fixture
    mm = a.metrics.task("level1/matmul")
    assert mm.best_eager.attempt_id == info.attempts["level1/matmul@2"]
    assert mm.best_compile.attempt_id == info.attempts["level1/matmul@2"]
    assert mm.best_by_round == {0: None, 1: 2.0, 2: 2.5}
    relu = a.metrics.task("level1/relu")
    assert relu.best.attempt_id == info.attempts["level1/relu@0"]   # the later incorrect one is not best
    assert relu.best_by_round == {0: 0.8, 1: 0.8}
    lse = a.metrics.task("level2/lse")
    assert lse.best_by_round == {0: None, 1: 1.2}


def test_loader_records(fixture):
    info, a, _ = fixture
    by_id = {r.attempt_id: r for r in a.records}
    r = by_id[info.attempts["level1/matmul@0"]]
    assert r.status == "compile_error" and not r.correct and r.runtime_ms == -1.0
    assert "identifier" in r.error
    r = by_id[info.attempts["level2/lse@0"]]
    assert r.status is None and r.parse_status == "no_code" and r.evaluation_id is None
    r = by_id[info.attempts["level1/matmul@2"]]
    assert r.correct and r.candidate_ms == 1.6 and r.runtime_ms == 1.6 and r.floor_fraction == 0.625
    assert r.parent_ids == [info.attempts["level1/matmul@1"]]
    r = by_id[info.attempts["level2/conv_gn@1"]]
    assert r.error.startswith("RuntimeError: CUDA error: an illegal memory access")
    assert a.analyses["level1/matmul"]["round"] == 2          # the latest of two analyses
    assert len(a.all_analyses) == 3


def test_tokens_only_from_this_run(fixture):
    _, a, b = fixture
    assert b.metrics.tokens == 4 * 1500                        # run B's own four propose calls
    assert a.metrics.tokens == 18100                           # not including run B's
    assert len(a.calls) == 9 + 2 + 1


def test_unknown_run(fixture):
    info, _, _ = fixture
    with info.store.reader() as s, pytest.raises(LookupError):
        load_run(s, 999)


# ------------------------------------------------------------------------ pure functions

def test_geomean_and_median():
    assert math.isclose(geomean([2.0, 8.0]), 4.0)
    assert geomean([]) is None and geomean([None, 0.0, -1.0]) is None
    assert math.isclose(geomean([None, 4.0, float("nan")]), 4.0)
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([None]) is None


def test_fast_p_is_strict_and_over_all_tasks():
    recs = [rec(1, "a", se=1.0), rec(2, "b", se=1.5), rec(3, "c", status="incorrect", clean=False),
            rec(4, "d", status="correct", clean=False, se=9.0, flags=["suspicious"])]
    m = compute_metrics(recs, task_names=["e"])          # task e has no attempt at all
    assert m.tasks == 5
    assert m.fast_p_eager == {"0": 0.4, "0.5": 0.4, "0.8": 0.4, "1": 0.2, "1.5": 0.0, "2": 0.0}
    # no attempt has a compile speedup: compile fast_p is unknown, not zero
    assert all(v is None for v in m.fast_p_compile.values())
    assert m.geomean_speedup_compile is None
    assert fast_p(m.per_task, 1.0, "eager") == 0.2


def test_best_attempt_ties_and_baselines():
    recs = [rec(1, se=2.0, sc=1.0, ms=5.0), rec(2, se=2.0, sc=1.5, ms=4.0), rec(3, se=1.0, sc=3.0, ms=6.0),
            rec(4, status="correct", clean=False, se=10.0, sc=10.0, flags=["impossible"])]
    assert best_attempt(recs, "eager").attempt_id == 2        # tie on speedup: lower time wins
    assert best_attempt(recs, "compile").attempt_id == 3      # each baseline has its own best
    t = task_metrics("t", recs)
    m = compute_metrics(recs)
    assert t.speedup("eager") == 2.0 and t.speedup("compile") == 3.0
    assert m.fast_p_compile["2"] == 1.0 and m.fast_p_eager["2"] == 0.0


def test_task_without_correct_shows_furthest_attempt():
    recs = [rec(1, status="compile_error", clean=False), rec(2, rnd=1, status="incorrect", clean=False),
            rec(3, rnd=2, status="runtime_error", clean=False)]
    t = task_metrics("t", recs)
    assert not t.correct and t.best.attempt_id == 2


def test_costs_and_tokens_pure():
    recs = [rec(1, "a", se=2.0), rec(2, "b", se=1.0)]
    calls = [CallRecord(1, "a", prompt_tokens=100, completion_tokens=50, cost_usd=0.5),
             CallRecord(2, "b", prompt_tokens=None, completion_tokens=None, cost_usd=None),
             CallRecord(3, "c", prompt_tokens=10, completion_tokens=0, cost_usd=0.1)]
    m = compute_metrics(recs, calls)
    assert m.tasks == 3                                  # task c only has a model call
    assert m.tokens == 160 and math.isclose(m.cost_usd, 0.6)
    assert math.isclose(m.tokens_per_correct_kernel, 80) and math.isclose(m.cost_per_correct_kernel, 0.3)
    none = compute_metrics([rec(1, status="incorrect", clean=False)], [CallRecord(1, "t", prompt_tokens=5)])
    assert none.tokens_per_correct_kernel is None and none.cost_usd is None and none.cost_per_correct_kernel is None


def test_empty_run():
    m = compute_metrics([])
    assert m.tasks == 0 and m.attempts == 0 and m.correctness_rate == 0.0
    assert all(v is None for v in m.fast_p_eager.values())
    assert m.geomean_speedup_eager is None and m.median_floor_fraction is None


def test_a_flag_given_twice_with_two_reasons_counts_one_attempt():
    """On an H100 a builtin fallback was flagged no_custom_kernel by the call counter and by the
    profiler: the report counted 248 flags over 124 attempts and listed the flag twice."""
    from evals.metrics import AttemptRecord, compute_metrics

    rec = AttemptRecord(task="t", attempt_id=1, round=0, sample=0, parse_status="ok", status="correct",
                        flags=["no_custom_kernel", "no_custom_kernel"])
    assert compute_metrics([rec]).flag_counts == {"no_custom_kernel": 1}
