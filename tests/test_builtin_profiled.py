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


def test_every_kernel_of_a_group_counts_whatever_its_suffix():
    """Session x, level3/47_NetVladNoGhostClusters at 0.92x eager: its batch norm's two-pass kernels
    (``kl_g0_part`` + ``kl_g0_fin``, 211 us) were the slowest group, but only ``kl_gN_kernel*`` names
    were read, so ``kl_g3_kernel4`` (78 us) was blamed and the next round ran 12% slower."""
    from agent.builtin.profiled import group_times

    names = [("void kl_g0_fin<int>(float const*, float*, int)", 159.3), ("void kl_g3_kernel4<int>(float const*)", 78.1),
             ("void kl_g1_regs<int>(float const*, float*, int)", 52.7), ("void kl_g0_part<int>(float const*)", 51.2),
             ("void kl_g2_col<int>(float const*, float*)", 11.0), ("void kl_g12_cols<int>(float const*)", 3.0),
             ("sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x64x8", 238.1)]
    times = group_times(_correct(0.92, names))
    assert times == pytest.approx({"kl_g0": 210.5, "kl_g3": 78.1, "kl_g1": 52.7, "kl_g2": 11.0, "kl_g12": 3.0})
