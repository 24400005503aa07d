"""Error patterns and speed intervals on hand-made tensors and timings (no builds): the map the
comparison stores (``sandbox.locate``) and the patterns the critics name from it."""
from __future__ import annotations

import pytest
import torch

from agent.critic.patterns import classify
from sandbox.compare import compare_outputs
from sandbox.intervals import speedup_interval
from sandbox.result import EvalConfig
from sandbox.timing import summarize

CFG = EvalConfig()


def patterns(ref: torch.Tensor, out: torch.Tensor) -> list:
    ok, _, checks = compare_outputs([ref], [out], CFG)
    assert not ok
    c = checks[0]
    assert c.locations is not None and c.locations.wrong == c.mismatched     # stored with the check
    return classify(c.locations, c.numel)


def kinds(ps) -> list[str]:
    return [p.kind for p in ps]


@pytest.fixture
def ref() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(128, 64) + 3.0


def test_tail_rows_name_the_floor_division(ref):
    out = ref.clone()
    out[96:] = 0
    ps = patterns(ref, out)
    assert kinds(ps) == ["tail", "zero"]
    assert ps[0].sentence == ("rows 96-127, the last 32 of 128 (one block of 32), are wrong (holding all 2048 wrong "
                              "elements); rows 0-95 are exact")
    assert "floor division" in ps[0].meaning


def test_head_rows_and_a_single_column(ref):
    out = ref.clone()
    out[:16] += 1
    assert patterns(ref, out)[0].sentence.startswith("rows 0-15, the first 16 of 128, are wrong")
    out = ref.clone()
    out[:, 5] += 1
    ps = patterns(ref, out)
    assert ps[0].kind == "group" and ps[0].sentence.startswith("only column 5 (one of 64) is wrong")


def test_every_kth_in_memory_order_when_no_axis_shows_it(ref):
    out = ref.clone()
    out.view(-1)[1::3] += 1                      # 3 does not divide 64: no column pattern
    ps = patterns(ref, out)
    assert ps[0].kind == "every_kth" and "every 3rd element in memory order" in ps[0].sentence


def test_values_sign_scale_transposition():
    torch.manual_seed(1)
    r = torch.randn(48, 48) + 2.0
    assert kinds(patterns(r, -r)) == ["everywhere", "sign"]
    scaled = patterns(r, r * 0.5)
    assert "0.5000 times the reference's value" in scaled[-1].sentence
    assert kinds(patterns(r, r.t().contiguous()))[-1] == "transposed"
    wide = torch.randn(16, 40) + 2.0
    t = patterns(wide, wide.t().contiguous().view(16, 40))
    assert t[-1].kind == "transposed" and "transpose (40 x 16) written in the reference's shape" in t[-1].sentence


def test_scattered_and_nonfinite(ref):
    out = ref.clone()
    out[3, 7] += 1
    out[77, 40] += 1
    out[120, 2] += 1
    ps = patterns(ref, out)
    assert kinds(ps) == ["scattered"] and "first at index [3, 7]" in ps[0].sentence
    out = ref.clone()
    out[50, 10:] = float("nan")
    ps = patterns(ref, out)
    assert ps[0].kind == "nonfinite" and "first appears at index [50, 10]" in ps[0].sentence


def test_integer_outputs_are_located_too():
    r = torch.arange(64 * 32).view(64, 32)
    out = r.clone()
    out[:, 28:] = 0
    ps = patterns(r, out)
    assert ps[0].kind == "tail" and ps[0].sentence.startswith("columns 28-31, the last 4 of 32")


def test_intervals_are_reproducible_and_honest():
    base = summarize([20.0 + 0.1 * (i % 5) for i in range(20)], "perf_counter")
    fast = summarize([10.0 + 0.1 * (i % 5) for i in range(20)], "perf_counter")
    noisy = summarize([1.0, 60.0] * 10, "perf_counter")
    a, b = speedup_interval(base, fast), speedup_interval(base, fast)
    assert a == b and a.label == "faster" and a.low > 1.9
    n = speedup_interval(base, noisy)
    assert n.label == "inconclusive" and n.low < 1.0 < n.high
    assert speedup_interval(fast, base).label == "slower"
    old = base.model_copy(update={"samples_ms": []})          # stored before per-run times were kept
    q = speedup_interval(old, fast)
    assert q.method == "iqr" and q.low <= q.point <= q.high
