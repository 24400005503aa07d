"""The numerics convention (sandbox.numerics): switches, casts, and the float64 rules."""
from __future__ import annotations

import pytest
import torch

from sandbox.compare import compare_outputs, fp64_bounds, fp64_errors, fp64_verdict, only_value_mismatches
from sandbox.harness import make_inputs, make_model
from sandbox.numerics import TORCH_DEFAULTS, Numerics, parse_numerics
from sandbox.result import EvalConfig
from sandbox.tasks import LoadedTask, TaskSpec

B = torch.backends


def _legacy() -> tuple[bool, bool, str]:
    return B.cudnn.allow_tf32, B.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()


# ------------------------------------------------------------------ switches
def test_default_is_pytorchs_own_defaults_and_strict_turns_tf32_off():
    assert TORCH_DEFAULTS["cudnn_allow_tf32"] is True and TORCH_DEFAULTS["matmul_allow_tf32"] is False
    with Numerics(math="strict").enforced():
        assert _legacy() == (False, False, "highest")
        with Numerics().enforced():
            assert _legacy() == (True, False, "highest")
        assert _legacy() == (False, False, "highest")
    assert _legacy() == (True, False, "highest")


@pytest.mark.skipif(not hasattr(B.cuda.matmul, "fp32_precision"), reason="this torch has no fp32_precision API")
@pytest.mark.parametrize("flip", [
    lambda: setattr(B.cuda.matmul, "fp32_precision", "tf32"),            # the new API
    lambda: setattr(B, "fp32_precision", "tf32"),
    lambda: torch.set_float32_matmul_precision("medium"),
    lambda: setattr(B.cudnn.conv, "fp32_precision", "ieee"),
])
@pytest.mark.parametrize("math", ["default", "strict"])
def test_a_switch_flipped_through_either_api_is_set_back(flip, math):
    numerics = Numerics(math=math)
    try:
        flip()                          # what a candidate might do between two requests
        numerics.enforce()              # what the worker does before the next one
        assert _legacy() == ((math == "default"), False, "highest")      # readable: no mixed-API error
        conv = B.cudnn.conv.fp32_precision
        assert conv == ("tf32" if math == "default" else "ieee")
        assert B.cuda.matmul.fp32_precision in (("none", "ieee") if math == "default" else ("ieee",))
    finally:
        Numerics().enforce()


def test_tf32_classes_follow_the_mode_and_the_precision():
    assert Numerics().tf32_classes("cuda") == {"conv"}
    assert Numerics(math="strict").tf32_classes("cuda") == set()
    assert Numerics().tf32_classes("cpu") == set()
    assert Numerics(precision="bf16").tf32_classes("cuda") == set()
    assert Numerics().label == "fp32/default" and "cuDNN convolutions in TF32" in Numerics().describe()


def test_parse_numerics_names_the_bad_option():
    assert parse_numerics("bf16", None) == Numerics(precision="bf16")
    assert parse_numerics(None, "strict", Numerics(precision="fp16")) == Numerics(precision="fp16", math="strict")
    with pytest.raises(ValueError, match="--precision"):
        parse_numerics("fp8", None)
    with pytest.raises(ValueError, match="--math"):
        parse_numerics(None, "fast")


def test_configs_stored_before_numerics_read_back_as_strict_fp32():
    old = {"trials": 5, "timed_runs": 20, "tol_fp32": {"atol": 1e-4, "rtol": 1e-4}, "fp64_factor": 3.0}
    cfg = EvalConfig.model_validate(old)
    assert cfg.numerics.label == "fp32/strict" and cfg.numerics.rms_factor == 3.0
    assert EvalConfig().numerics.label == "fp32/default"
    assert EvalConfig.model_validate(EvalConfig(numerics=Numerics(precision="bf16")).model_dump(mode="json")) \
        .numerics.precision == "bf16"
    assert EvalConfig().hash() != EvalConfig(numerics=Numerics(math="strict")).hash()   # never reused across


# ------------------------------------------------------------------ casts (KernelBench's)
SOURCE = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("scale", scale)
    def forward(self, x, idx):
        return self.lin(x)[idx] * self.scale

def get_inputs():
    return [torch.randn(6, 8), torch.tensor([0, 2, 5])]

def get_init_inputs():
    return [torch.tensor(2.0)]
'''


def _task() -> LoadedTask:
    ns: dict = {}
    exec(SOURCE, ns)
    return LoadedTask(spec=TaskSpec(name="t", path="t.py", source=SOURCE), namespace=ns)


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_model_and_floating_inputs_are_cast_and_indices_are_not(precision, dtype):
    task, numerics = _task(), Numerics(precision=precision)
    model = make_model(task.Model, task, 0, "cpu", numerics)
    x, idx = make_inputs(task, 1, "cpu", numerics)
    assert x.dtype == dtype and idx.dtype == torch.int64
    assert {p.dtype for p in model.parameters()} == {dtype} and model.scale.dtype == dtype
    # the same values as the fp32 model, rounded once (the seed before each constructor)
    ref = make_model(task.Model, task, 0, "cpu")
    assert torch.equal(model.lin.weight, ref.lin.weight.to(dtype))
    assert model(x, idx).dtype == dtype


# ------------------------------------------------------------------ the float64 rule
def _round_mantissa(x: torch.Tensor, keep_bits: int) -> torch.Tensor:
    """x rounded (to nearest) to ``keep_bits`` explicit significand bits, still float32."""
    drop = 23 - keep_bits
    i = x.view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def _case(seed: int = 0):
    """A GEMM whose float32 reference rounds its operands to 10 bits (TF32-like, as cuDNN does
    in PyTorch's default mode), its float64 run, and an exact float32 result."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(256, 1024, generator=g), torch.randn(1024, 96, generator=g)
    ref64 = a.double() @ b.double()
    rounded_ref = _round_mantissa(a, 10) @ _round_mantissa(b, 10)
    exact = a @ b
    return a, b, ref64, rounded_ref, exact


def test_more_accurate_than_a_rounded_reference_passes_by_the_float64_rule():
    a, b, ref64, ref, exact = _case()
    cfg = EvalConfig()
    ok, reason, checks = compare_outputs([ref], [exact], cfg)
    assert not ok and checks[0].mismatched > 0          # KernelBench's rule alone fails it
    assert only_value_mismatches(checks)
    bounds = fp64_bounds([ref], [ref64], cfg.numerics)
    ok, reason, checks = compare_outputs([ref], [exact], cfg, bounds)
    assert ok, reason
    assert checks[0].mismatched == 0 and checks[0].outside_tolerance > 0
    assert checks[0].ref_fp64_max_abs == pytest.approx(float((ref.double() - ref64).abs().max()))
    ref_rel, cand_rel = fp64_errors(ref, exact, ref64)
    assert cand_rel < ref_rel / 100                      # 100x closer to float64 than the reference


def test_the_same_rounding_as_the_reference_passes_and_a_narrower_one_fails():
    a, b, ref64, ref, _ = _case(1)
    cfg = EvalConfig()
    bounds = fp64_bounds([ref], [ref64], cfg.numerics)
    # the same TF32-like rounding, another summation order: like cuDNN picking another algorithm
    alike = sum(_round_mantissa(a[:, k:k + 128], 10) @ _round_mantissa(b[k:k + 128], 10) for k in range(0, 1024, 128))
    assert compare_outputs([ref], [alike], cfg, bounds)[0]
    # 7 bits (bfloat16-like internals): farther from float64 than twice the reference's worst error
    narrow = _round_mantissa(a, 7) @ _round_mantissa(b, 7)
    ok, reason, checks = compare_outputs([ref], [narrow], cfg, bounds)
    assert not ok and "farther from float64" in reason


def test_lowered_precision_fails_where_the_reference_is_full_fp32():
    a, b, ref64, _, exact = _case(2)
    cfg = EvalConfig(numerics=Numerics(math="strict"))
    bounds = fp64_bounds([exact], [ref64], cfg.numerics)
    tf32_like = _round_mantissa(a, 10) @ _round_mantissa(b, 10)
    ok, _, checks = compare_outputs([exact], [tf32_like], cfg, bounds)
    assert not ok and checks[0].mismatched > 0


def test_the_float64_rule_never_rescues_nan_or_a_reference_far_from_float64():
    a, b, ref64, ref, exact = _case(3)
    cfg = EvalConfig()
    bounds = fp64_bounds([ref], [ref64], cfg.numerics)
    bad = exact.clone()
    bad[0, 0] = float("nan")
    ok, _, checks = compare_outputs([ref], [bad], cfg, bounds)
    assert not ok and checks[0].nan_count == 1 and not only_value_mismatches(checks)
    # a reference that computed something else than its float64 run (random numbers in forward)
    assert fp64_bounds([ref], [torch.randn_like(ref64)], cfg.numerics) == [None]
    assert fp64_bounds([ref.int()], [ref64], cfg.numerics) == [None]


def test_the_rms_rule_scales_with_the_precisions_epsilon():
    x = torch.randn(4096, dtype=torch.float64)
    ref16 = x.half()
    worse = (x + 6e-3 * torch.randn_like(x)).half()        # 2x + 4 fp16 epsilons allows 4.3e-3
    checks = compare_outputs([ref16], [worse], EvalConfig(numerics=Numerics(precision="fp16")))[2]
    checks[0].ref_fp64_rel_rms, checks[0].fp64_rel_rms = fp64_errors(ref16, worse, x)
    fp16 = Numerics(precision="fp16")
    assert fp64_verdict(checks[0], fp16) is not None and "fp16 epsilons" in fp64_verdict(checks[0], fp16)
    same = (x.float() + 0).half()
    checks[0].ref_fp64_rel_rms, checks[0].fp64_rel_rms = fp64_errors(ref16, same, x)
    assert fp64_verdict(checks[0], fp16) is None
