"""The numerics convention through the real sandbox on the CPU target (real builds, real trials).

tests/numerics/task_rounded_gemm.py computes like a TF32 convolution in PyTorch's default mode
(operands rounded to 10 bits in float32, exact in its float64 copy), so the CPU can show what
the float64 rule decides: a candidate more accurate than the reference passes, one computing
like the reference passes, one narrower fails. tests/numerics/cpu/bf16_relu_scale.py runs the
adversarial suite's small task under --precision bf16.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandbox.evaluate import Sandbox
from sandbox.numerics import Numerics
from sandbox.result import EvalConfig
from sandbox.tasks import read_spec

from remeasure import remeasured

HERE = Path(__file__).parent
ROUNDED = read_spec(HERE / "numerics" / "task_rounded_gemm.py", name="numerics/task_rounded_gemm")
SMALL = read_spec(HERE / "adversarial" / "task_small.py", name="adversarial/task_small")


def _config(numerics: Numerics) -> EvalConfig:
    return EvalConfig(trials=3, timed_runs=5, warmup_runs=1, time_compile=False, profile=False,
                      run_timeout_s=60.0, build_timeout_s=600.0, numerics=numerics)


def _expected(path: Path) -> str:
    return re.search(r"^# expect-status: (\S+)", path.read_text(), re.M).group(1)


@pytest.fixture(scope="module")
def default_sandbox():
    with Sandbox("cpu", _config(Numerics()), build_slots=1) as sandbox:
        yield sandbox


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full_fp32", "rounded_like_reference", "narrower_than_reference"])
def test_the_float64_rule_through_the_sandbox(default_sandbox, name):
    path = HERE / "numerics" / "cpu" / f"{name}.py"
    result = remeasured(lambda: default_sandbox.evaluate(ROUNDED, path.read_text()))
    detail = f"{name}: {result.status.value} {result.error_message} {[t.reason for t in result.trials]}"
    assert result.status.value == _expected(path), detail
    outputs = [o for t in result.trials for o in t.outputs]
    if name == "full_fp32":
        assert result.clean, detail                                  # not flagged inaccurate either
        assert any(o.outside_tolerance > 0 for o in outputs)          # KernelBench's rule alone fails it
        assert all(o.mismatched == 0 for o in outputs)
        first = result.trials[0].outputs[0]
        assert first.fp64_rel_rms < first.ref_fp64_rel_rms / 100      # 100x closer to float64
    if name == "narrower_than_reference":
        assert "farther from float64" in result.first_failed_trial().reason


@pytest.mark.slow
def test_bf16_precision_through_the_sandbox():
    path = HERE / "numerics" / "cpu" / "bf16_relu_scale.py"
    with Sandbox("cpu", _config(Numerics(precision="bf16")), build_slots=1) as sandbox:
        result = remeasured(lambda: sandbox.evaluate(SMALL, path.read_text()))
        assert result.clean, f"{result.status.value} {result.error_message} {result.first_failed_trial()}"
        check = result.trials[0].outputs[0]
        assert check.dtype == "bfloat16" and check.tolerance.atol == pytest.approx(1e-2)
        assert check.fp64_rel_rms is not None and check.ref_fp64_rel_rms is not None
        # the float32 candidate of the adversarial suite reads float pointers: not a bf16 kernel
        fp32 = sandbox.evaluate(SMALL, (HERE / "adversarial" / "cpu" / "honest.py").read_text())
        assert not fp32.correct
    assert result.config.numerics.label == "bf16/default"
