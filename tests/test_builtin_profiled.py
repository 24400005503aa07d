"""Across rounds the profile decides: a correct attempt slower than eager loses its slowest
generated group to PyTorch (``agent.builtin.profiled``). No compiler, no sandbox."""
from __future__ import annotations

from pathlib import Path

import pytest

import agent.builtin as builtin
from agent.builtin import parse_header, propose
from agent.builtin.feedback import read_history
from agent.types import AttemptView
from sandbox.result import EvalResult, KernelStat, Status, Timing
from sandbox.tasks import read_spec

BN = Path(__file__).parent / "fixtures" / "builtin" / "train_batchnorm.py"


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _correct(speedup: float, profile: list[tuple[str, float]]) -> EvalResult:
    t = Timing(median_ms=1.0, iqr_ms=0.0, mean_ms=1.0, min_ms=1.0, max_ms=1.0, runs=5, clock="cuda_event")
    return EvalResult(status=Status.correct, task="t", device="cuda", candidate_time=t, speedup_eager=speedup,
                      profile=[KernelStat(name=n, count=10, total_us=us, share=0.1, own=True) for n, us in profile])


def _history(speedup: float):
    spec = read_spec(BN, name="fixtures/train_batchnorm")
    src = propose(spec, "cuda", 0, 0, []).source
    groups = parse_header(src)["groups"]
    assert len(groups) >= 2
    slow, other = groups[0], groups[1]
    result = _correct(speedup, [(f"void {slow['name']}_kernel4<int>(float const*, float*)", 900.0),
                                (f"{other['name']}_kernel(float const*)", 50.0),
                                ("void at::native::vectorized_elementwise_kernel<4>", 2000.0)])
    return spec, [AttemptView(attempt_id=1, round=0, sample=0, parse_status="ok", source=src, result=result)], slow


def test_the_slowest_group_of_an_attempt_slower_than_eager_goes_back_to_pytorch():
    spec, history, slow = _history(0.66)
    fb = read_history(history, "cuda")
    assert set(slow["nodes"]) <= fb.excluded
    assert any("0.66x eager" in n and slow["name"] in n for n in fb.notes)
    nxt = propose(spec, "cuda", 1, 0, history)
    assert set(slow["nodes"]) <= set(nxt.choices["excluded"])
    assert all(g["nodes"] != slow["nodes"] for g in nxt.choices["groups"])


def test_an_attempt_faster_than_eager_keeps_its_groups():
    _, history, slow = _history(1.3)
    fb = read_history(history, "cuda")
    assert not (set(slow["nodes"]) & fb.excluded) and not fb.notes
