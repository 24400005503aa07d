"""Attention in one kernel (agent/builtin/attention.py): the causal softmax attention of
level3/43, the ReLU attention of level3/50 and a softmax attention under a mask that is not
causal, matched in the traced graph, replayed in float64 and run for real in the CPU sandbox."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate, propose, replay_verdict
from sandbox.tasks import read_spec, with_device_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
PAIR = FIXTURES / "attention_pair.py"
MINGPT = FIXTURES / "masked_attention.py"


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _spec(path: Path):
    return read_spec(path, name=f"fixtures/{path.stem}")


def test_each_attention_becomes_one_kernel_and_the_projections_stay_gemms():
    cand = generate(_spec(PAIR), "cpu")
    groups = cand.choices["groups"]
    assert [g["ops"] for g in groups] == [["attention_softmax"], ["attention_relu"], ["attention_softmax"]]
    for g in groups:
        assert g["kind"] == "attention" and g["nodes"][-1].startswith("matmul")
    src = cand.source
    assert src.count("_cpu(const void* const* ins") == 3           # three generated kernels
    assert "v_matmul_1 = _ext.kl_g0(" in src and "v_matmul_5 = _ext.kl_g2(" in src
    # the scores are never materialised by PyTorch: no matmul of q and k^T, no masked_fill, no softmax
    code = "\n".join(line for line in src.split("def forward")[1].splitlines() if not line.strip().startswith("#"))
    assert " @ " not in code and ".masked_fill(" not in code and "softmax(" not in code
    assert "self.c_attn(x)" in src and "self.c_proj(" in src


def test_the_library_variant_keeps_the_matmuls_and_is_the_second_sample():
    spec = _spec(PAIR)
    lib = generate(spec, "cpu", Knobs(attention="library"))
    assert lib.choices["knobs"]["attention"] == "library"
    assert not any(g["kind"] == "attention" for g in lib.choices["groups"])
    assert "v_matmul = v_transpose_1 @ v_transpose_3" in lib.source
    first, second = propose(spec, "cpu", 0, 0, []), propose(spec, "cpu", 0, 1, [])
    assert first.choices["knobs"]["attention"] == "fused"
    assert second.choices["knobs"]["attention"] == "library"


def test_a_model_without_attention_normalises_the_knob():
    lib = generate(_spec(FIXTURES / "lstm_cell.py"), "cpu", Knobs(attention="library"))
    assert lib.choices["knobs"]["attention"] == "fused"


def test_the_replay_checks_the_fused_kernel_and_catches_a_wrong_one(monkeypatch):
    spec = _spec(PAIR)
    verdict = replay_verdict(spec)
    assert verdict.ran and not verdict.excluded, verdict.notes
    # plant a planning bug: the ReLU attention emulated (and planned) as a softmax one
    from agent.builtin import attention

    real = attention._match

    def wrong(m2, infos):
        sp = real(m2, infos)
        if sp is not None and sp.act == "relu":
            sp.act = "softmax"
        return sp

    monkeypatch.setattr(attention, "_match", wrong)
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})
    verdict = replay_verdict(spec)
    assert verdict.semantic == ["kl_g1"], verdict.notes
    assert "relu" in verdict.excluded and "matmul_3" in verdict.excluded


def test_fused_attention_is_correct_in_the_cpu_sandbox():
    """One C++ build: the three fused kernels, at T = 37 (no multiple of a tile), judged by the
    sandbox against the reference (fp32 tolerance, float64 rule)."""
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status

    spec = with_device_sizes(_spec(PAIR), "cpu")
    cand = propose(spec, "cpu", 0, 0, [])
    assert sum(g["kind"] == "attention" for g in cand.choices["groups"]) == 3
    assert "kl_g0_cpu" in cand.source and "expf(m - s)" in cand.source
    cfg = EvalConfig(numerics=Numerics(), trials=2, warmup_runs=1, timed_runs=2, time_compile=False, profile=False)
    result = evaluate(spec, cand.source, "cpu", cfg)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and all(c.mismatched == 0 for c in checks)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_attention_is_correct_on_cuda(precision):
    """The CUDA kernel (cuda_attn.cu.j2) judged by the sandbox on a GPU: causal softmax, causal ReLU
    and the non-causal mask, T = 37 (a partial query tile and key tile), in fp32 and bf16."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status

    spec = _spec(PAIR)
    numerics = Numerics(precision=precision)
    cand = propose(spec, "cuda", 0, 0, [], numerics=numerics)
    assert sum(g["kind"] == "attention" for g in cand.choices["groups"]) == 3
    cfg = EvalConfig(numerics=numerics, trials=3, warmup_runs=1, timed_runs=3, time_compile=False, profile=False)
    result = evaluate(spec, cand.source, "cuda", cfg)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
