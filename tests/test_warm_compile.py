"""A reference's warm-up compile asks for the device in turns (``sandbox.warm_compile``): inductor's
GPU benchmarks during compilation take a turn of their own, through torch's benchmark-lock hook
where it has one (2.13) and through its ``benchmarker`` object where it has not (the GPU host's
2.11), and whatever was replaced is put back."""
from __future__ import annotations

import pytest

from sandbox.warm_compile import ReferenceTurns, _gate_benchmarks

benchmarking = pytest.importorskip("torch._inductor.runtime.benchmarking")


class _Turns:
    """``DeviceTurns``' interface, counting what was asked for."""

    def __init__(self):
        self.held, self.asked = False, []

    def want(self, why):
        assert not self.held, "a turn asked for while one is held"
        self.held = True
        self.asked.append(why)

    def done(self):
        self.held = False


def test_with_torchs_hook_a_benchmark_takes_a_turn_and_the_hook_is_restored():
    if not hasattr(benchmarking, "set_gpu_benchmark_lock_context"):
        pytest.skip("this torch has no benchmark lock hook (the other test covers it)")
    turns = _Turns()
    undo = _gate_benchmarks(ReferenceTurns(turns, "cpu"))
    try:
        with benchmarking.maybe_gpu_benchmark_lock():
            assert turns.held
            with benchmarking.maybe_gpu_benchmark_lock():      # nested, as torch's helpers do
                assert turns.held
        assert not turns.held and len(turns.asked) == 1
    finally:
        undo()
    with benchmarking.maybe_gpu_benchmark_lock():
        assert not turns.held                                 # the hook is torch's again
    assert len(turns.asked) == 1


def test_without_the_hook_the_benchmarker_object_takes_turns_and_is_put_back(monkeypatch):
    monkeypatch.delattr(benchmarking, "set_gpu_benchmark_lock_context", raising=False)
    bench = benchmarking.benchmarker
    seen = []
    monkeypatch.setattr(type(bench), "benchmark_gpu", lambda self, fn, *a, **k: seen.append(turns.held) or 1.0)
    turns = _Turns()
    undo = _gate_benchmarks(ReferenceTurns(turns, "cpu"))
    assert undo is not None
    try:
        assert bench.benchmark_gpu(lambda: None) == 1.0
        assert seen == [True] and not turns.held and len(turns.asked) == 1
    finally:
        undo()
    assert "benchmark_gpu" not in vars(bench)
    bench.benchmark_gpu(lambda: None)
    assert seen == [True, False] and len(turns.asked) == 1


def test_with_no_way_to_gate_benchmarks_the_compilation_keeps_its_turn(monkeypatch):
    monkeypatch.delattr(benchmarking, "set_gpu_benchmark_lock_context", raising=False)
    monkeypatch.setattr(benchmarking, "benchmarker", object())
    assert _gate_benchmarks(ReferenceTurns(_Turns(), "cpu")) is None
