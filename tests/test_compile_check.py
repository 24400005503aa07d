"""torch.compile's own output checked against eager's where the judge times it (``time_compile``):
a speedup vs torch.compile is quoted against a baseline that may compute something else (on an
H200, compile's channels-last TF32 convolutions put level2/21, 73, 85 and 17 outside 1e-4 of eager,
whose NCHW convolutions are full fp32). The check uses KernelBench's rule, allclose at the
precision's tolerance, on the first timed run's inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sandbox.numerics import Numerics
from sandbox.worker_util import compiled_check

FIXTURES = Path(__file__).parent / "fixtures" / "compile_check"
NUM = Numerics()


def test_the_check_passes_equal_outputs_and_names_the_largest_difference():
    x = torch.randn(32, 16)
    same = compiled_check(lambda t: t * 2, lambda t: t * 2, lambda: [x], NUM, "cpu")
    assert same == {"within": True, "max_abs": 0.0, "tolerance": 1e-4}
    off = compiled_check(lambda t: (t * 2, t), lambda t: (t * 2, t + 1e-3), lambda: [x], NUM, "cpu")
    assert off["within"] is False and off["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    # rtol: a large value 1e-5 off (relative 1e-6) is within KernelBench's 1e-4
    assert compiled_check(lambda t: t * 0 + 100.0, lambda t: t * 0 + 100.00001, lambda: [x], NUM, "cpu")["within"] is True
    # NaN where both have it is equal; different shapes or a non-tensor output are outside
    nan = torch.tensor([float("nan"), 1.0])
    assert compiled_check(lambda t: nan, lambda t: nan.clone(), lambda: [x], NUM, "cpu") == {"within": True, "max_abs": 0.0,
                                                                             "tolerance": 1e-4}
    assert compiled_check(lambda t: t, lambda t: t[:1], lambda: [x], NUM, "cpu")["within"] is False
    assert compiled_check(lambda t: 1.0, lambda t: 1.0, lambda: [x], NUM, "cpu")["max_abs"] is None

    def boom(t):
        raise RuntimeError("CUDA out of memory")

    assert compiled_check(lambda t: t, boom, lambda: [x], NUM, "cpu") == {"error": "RuntimeError: CUDA out of memory"}


def test_the_float64_rule_flags_a_compiled_output_within_the_tolerance_but_far_less_accurate_than_eager():
    """The rule the judge applies to candidates (relative RMS error against float64 at most twice
    eager's plus four epsilons), applied to torch.compile's output where a float64 run is given."""
    x = torch.randn(32, 16)
    model = lambda t: torch.tanh(t) * 2     # noqa: E731
    fp64 = lambda xs: ([torch.tanh(xs[0].double()) * 2], None)     # noqa: E731
    inexact = compiled_check(model, lambda t: model(t) * (1 + 1e-5), lambda: [x], NUM, "cpu", fp64)
    assert inexact["within"] is True
    assert inexact["fp64_note"].startswith("output 0: relative RMS error 1e-05 against the reference run in float64")
    assert compiled_check(model, model, lambda: [x], NUM, "cpu", fp64)["fp64_note"] is None
    # once a worker (memo): the float64 run is not made again, its answer kept
    runs, memo = [], {}

    def counted(xs):
        runs.append(1)
        return fp64(xs)

    for _ in range(3):
        again = compiled_check(model, lambda t: model(t) * (1 + 1e-5), lambda: [x], NUM, "cpu", counted, memo)
        assert again["fp64_note"] == inexact["fp64_note"]
    assert len(runs) == 1
    # no float64 run (it failed, or does not apply): nothing said
    assert compiled_check(model, lambda t: model(t) * (1 + 1e-5), lambda: [x], NUM, "cpu",
                          lambda xs: (None, "the reference did not run in float64"))["fp64_note"] is None


@pytest.mark.slow
def test_eval_says_when_torch_compiles_own_output_is_outside_the_tolerance(capsys):
    """A real evaluation on the CPU, the reference also timed under torch.compile: the result carries
    the check (stored with it) and ``eval`` says the speedup's baseline would fail KernelBench's check."""
    from typer.testing import CliRunner

    from kernelloop.cli import app
    from sandbox.cli import print_result
    from sandbox.result import EvalResult

    res = CliRunner().invoke(app, ["eval", str(FIXTURES / "compile_differs.py"), str(FIXTURES / "candidate.py"),
                                   "--device", "cpu", "--trials", "1", "--timed-runs", "2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output[res.output.index("{"):])
    assert data["compile_within_tolerance"] is False and data["compile_max_abs_error"] == pytest.approx(1e-3, rel=1e-3)
    assert data["compile_time"] is not None and data["speedup_compile"] is not None
    print_result(EvalResult.model_validate(data))
    assert ("torch.compile's own output is outside the tolerance of eager's (largest difference 0.001)"
            in capsys.readouterr().out.replace("\n", " "))


@pytest.mark.slow
def test_eval_says_when_torch_compiles_own_output_fails_the_float64_rule(capsys):
    """The same through a real evaluation on the CPU: compile's output within 1e-4 of eager's but
    1e-5 off relatively, where eager is exact: stored with the result, and said by ``eval``."""
    from typer.testing import CliRunner

    from kernelloop.cli import app
    from sandbox.cli import print_result
    from sandbox.result import EvalResult

    res = CliRunner().invoke(app, ["eval", str(FIXTURES / "compile_inexact.py"), str(FIXTURES / "candidate.py"),
                                   "--device", "cpu", "--trials", "1", "--timed-runs", "2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output[res.output.index("{"):])
    assert data["compile_within_tolerance"] is True
    assert "relative RMS error 1e-05 against the reference run in float64" in data["compile_fp64_note"]
    print_result(EvalResult.model_validate(data))
    assert "torch.compile's own output fails the float64 rule applied to candidates" in \
        " ".join(capsys.readouterr().out.split())
