"""The builtin generator under the run's precision (``sandbox.numerics.Numerics``).

Under ``fp16``/``bf16`` the reference is traced in the half type, the kernels load and store
``c10::Half``/``c10::BFloat16`` and compute and accumulate in float, the split-TF32 GEMM is
never offered and the feedback reads only attempts of the run's precision. Everything here
runs without a compiler except the ``slow`` tests (real CPU builds: through the sandbox for
two seeds, in process for the all-operators fixture) and the ``gpu`` test.
"""
from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate, parse_header, propose
from agent.builtin.feedback import precision_doubt, read_history, variant_order
from agent.builtin.trace import trace_task
from agent.types import AttemptView
from sandbox.numerics import Numerics
from sandbox.result import EvalConfig, EvalResult, Flag, FlagKind, Status, Timing
from sandbox.tasks import load_task, read_spec, with_device_sizes

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
EW_TASK = ROOT / "tasks" / "seeds" / "conv2d_divide_leakyrelu.py"             # conv -> add, div, leaky_relu
GN_TASK = ROOT / "tasks" / "seeds" / "conv2d_bias_scale_sigmoid_groupnorm.py"  # ... -> sigmoid -> group_norm
LSE_TASK = ROOT / "tasks" / "seeds" / "gemm_sigmoid_gemm_logsumexp.py"         # sigmoid; logsumexp
GEMM_TANH_MAX = ROOT / "tasks" / "level2" / "gemm_tanh_max.py"                 # a tc3 GEMM under fp32
HALF = {"fp16": ("c10::Half", "at::kHalf", torch.float16), "bf16": ("c10::BFloat16", "at::kBFloat16", torch.bfloat16)}


def _spec(path: Path):
    if not path.is_file():
        pytest.skip(f"{path.relative_to(ROOT)} is not in this checkout")
    return read_spec(path)


def _code(source: str) -> str:
    """The C++ (and CUDA) text of a candidate."""
    return source[source.index('_CPP_SOURCE = r"""'):source.index("def _build")]


def _result(status: Status, ms=None, flags=(), fp64=False) -> EvalResult:
    timing = Timing(median_ms=ms, iqr_ms=0.0, mean_ms=ms, min_ms=ms, max_ms=ms, runs=5,
                    clock="perf_counter") if ms is not None else None
    r = EvalResult(status=status, task="t", device="cpu", candidate_time=timing,
                   flags=[Flag(kind=FlagKind(k), reason=why) for k, why in flags])
    if fp64:
        r.trials = [types.SimpleNamespace(outputs=[types.SimpleNamespace(fp64_rel_rms=1e-3)])]
    return r


def _attempt(i: int, source: str, result: EvalResult) -> AttemptView:
    return AttemptView(attempt_id=i, round=0, sample=i, parse_status="ok", source=source, result=result)


# --------------------------------------------------------------------------------------
# tracing and generated sources (no compiler)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_trace_is_taken_in_the_runs_precision(precision):
    spec = _spec(GN_TASK)
    dtype = HALF[precision][2]
    half = trace_task(spec, "cuda", Numerics(precision=precision))
    full = trace_task(spec, "cuda")
    assert half.ok and full.ok and half is not full
    assert half.precision == precision and full.precision == "fp32"
    for traced, want in ((half, dtype), (full, torch.float32)):
        metas = [n.meta["tensor_meta"] for n in traced.gm.graph.nodes if hasattr(n.meta.get("tensor_meta"), "dtype")]
        assert metas and {m.dtype for m in metas} == {want}
        assert traced.modules["group_norm"].weight.dtype == want


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_kernels_load_and_store_the_half_type_and_compute_in_float(device, precision):
    ctype, at, _ = HALF[precision]
    for path in (EW_TASK, GN_TASK, LSE_TASK):
        cand = propose(_spec(path), device, 0, 0, [], numerics=Numerics(precision=precision))
        code = _code(cand.source)
        assert cand.choices["precision"] == precision and parse_header(cand.source) == cand.choices
        assert cand.choices["groups"] and cand.uncovered_ops == []
        assert "#include <c10/util/Half.h>" in code and "#include <c10/util/BFloat16.h>" in code
        # every input and the output in the half type; each load converted to float on its own
        assert re.search(rf"const {ctype}\* __restrict__ in0\b", code)
        assert re.search(rf"[(,] {ctype}\* __restrict__ out\b", code)
        assert f"static_cast<float>(in0[" in code
        assert not re.search(r"const float\* __restrict__ in\d", code)
        assert not re.search(r"[(,] float\* __restrict__ out\b", code)
        # the wrapper checks the dtype, allocates the output in it and passes its pointers
        assert f"kl_prep(t0, {at}, who," in code and f".options().dtype({at})" in code
        assert f"data_ptr<{ctype}>()" in code and "data_ptr<float>()" not in code
        # the element bodies compute in float
        assert re.search(r"const float t_\w+ = ", code)
        assert f"Precision {precision}:" in cand.source
    # reductions and norms accumulate in float (the CPU's sums and statistics in double)
    # (the norm's row kernels: NCHW; channels-last, the seed's group norm takes the column kernels)
    gn = _code(generate(_spec(GN_TASK), device, Knobs(layout="nchw"), numerics=Numerics(precision=precision)).source)
    lse = _code(propose(_spec(LSE_TASK), device, 0, 0, [], numerics=Numerics(precision=precision)).source)
    if device == "cpu":
        assert "double s1 = 0.0, s2 = 0.0;" in gn
    else:
        assert "float wK = 0.f, wn = 0.f, ws1 = 0.f, ws2 = 0.f, wm, wm2;" in gn
        assert "__shared__ float sh[99];" in gn
        # 4-element vector loads of a 2-byte type: 8-byte KlVec4s, aligned to 8 bytes
        assert f"KlVec4<{ctype}>" in gn and f"kl_aligned_to(ins[0], 8)" in gn and "float4 v0" not in gn
    # the running max in float; the sum of exponentials in float on cuda, in double on the CPU's rows
    assert ("float m; double s;" if device == "cpu" else "float m; float s;") in lse \
        or "float m = -INFINITY; float s = 0.f;" in lse
    assert "kl_lse_final(m" in lse


def test_fp32_sources_keep_float_and_no_c10_headers():
    cand = generate(_spec(GN_TASK), "cuda", Knobs(layout="nchw"))      # the norm's row kernel, float4 loads
    code = _code(cand.source)
    assert cand.choices["precision"] == "fp32"
    assert "c10/util/Half.h" not in code and "c10::Half" not in code and "KlVec4" not in code
    assert "const float* __restrict__ in0" in code and "float4 v0" in code and "kl_aligned_to(ins[0], 16)" in code
    assert "kl_prep(t0, at::kFloat, who," in code and "data_ptr<float>()" in code


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_split_tf32_gemm_is_for_fp32_only(precision):
    spec = _spec(GEMM_TANH_MAX)
    assert generate(spec, "cuda").choices["tc3"] == ["linear"]
    for cand in (generate(spec, "cuda", numerics=Numerics(precision=precision)),
                 propose(spec, "cuda", 0, 0, [], numerics=Numerics(precision=precision))):
        assert cand.choices["tc3"] == [] and cand.choices["knobs"]["matmul"] == "ieee"
        assert "kl_tc_" not in cand.source and "self.linear(" in cand.source
        assert "split-TF32 GEMM is for fp32 only" in cand.source
    # no variant offers it either
    assert {k.matmul for k in variant_order(read_history([], "cuda", precision))} == {"ieee"}
    assert {k.matmul for k in variant_order(read_history([], "cuda"))} == {"tc3", "ieee"}


def test_an_unsupported_dtype_stays_on_pytorch_with_a_comment(tmp_path):
    path = tmp_path / "double_tail.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n\n"
        "    def forward(self, x):\n"
        "        y = torch.sigmoid(x) * 2.0\n"
        "        z = y.double()\n"
        "        return torch.relu(z) + 1.0\n\n\n"
        "def get_inputs():\n    return [torch.randn(4, 33)]\n\n\n"
        "def get_init_inputs():\n    return []\n")
    spec = read_spec(path, name="fixtures/double_tail")
    cand = propose(spec, "cpu", 0, 0, [], numerics=Numerics(precision="bf16"))
    assert [g["ops"] for g in cand.choices["groups"]] == [["sigmoid", "mul"]]
    assert "const c10::BFloat16* __restrict__ in0" in cand.source
    assert re.search(r"# not covered by builtin: relu \(a float64 tensor: the builtin kernels read float32, "
                     r"float16 and bfloat16 only, it stays on PyTorch\)", cand.source)


# --------------------------------------------------------------------------------------
# the feedback reads the run's precision
# --------------------------------------------------------------------------------------
def test_feedback_reads_only_attempts_of_the_runs_precision():
    spec = _spec(EW_TASK)
    fp32 = propose(spec, "cpu", 0, 0, []).source
    fp16 = propose(spec, "cpu", 0, 0, [], numerics=Numerics(precision="fp16")).source
    legacy = re.sub(r'"precision":"fp32",', "", fp32)          # a header written before precisions: fp32
    assert parse_header(legacy) is not None and "precision" not in parse_header(legacy)
    history = [_attempt(1, fp32, _result(Status.incorrect)), _attempt(2, legacy, _result(Status.correct, 2.0)),
               _attempt(3, fp16, _result(Status.correct, 1.0))]
    fb16 = read_history(history, "cpu", "fp16")
    assert fb16.best_ms == 1.0 and fb16.best["precision"] == "fp16" and not fb16.cuts and not fb16.excluded
    fb32 = read_history(history, "cpu", "fp32")
    assert fb32.best_ms == 2.0 and "precision" not in fb32.best
    assert fb16.seen == fb32.seen and len(fb16.seen) == 2      # no source is proposed twice, whatever its precision
    again = propose(spec, "cpu", 1, 0, history, numerics=Numerics(precision="fp16"))
    assert again.source.split("\n", 1)[1] != fp16.split("\n", 1)[1]


def test_feedback_reads_only_attempts_of_the_runs_math_mode():
    """A time or verdict taken under strict math (full-fp32 library convolutions) says nothing
    about default math (TF32 ones), and the other way round; headers without a mode count for both."""
    spec = _spec(EW_TASK)
    default = propose(spec, "cpu", 0, 0, [], numerics=Numerics(math="default")).source
    strict = propose(spec, "cpu", 0, 0, [], numerics=Numerics(math="strict")).source
    assert parse_header(default)["math"] == "default" and parse_header(strict)["math"] == "strict"
    history = [_attempt(1, default, _result(Status.correct, 3.0)), _attempt(2, strict, _result(Status.correct, 1.0))]
    assert read_history(history, "cpu", "fp32", "default").best_ms == 3.0
    assert read_history(history, "cpu", "fp32", "strict").best_ms == 1.0
    assert read_history(history, "cpu", "fp32").best_ms == 1.0         # no mode asked: all of this precision
    unmarked = propose(spec, "cpu", 0, 0, []).source
    assert "math" not in parse_header(unmarked)
    assert read_history([_attempt(3, unmarked, _result(Status.correct, 2.0))], "cpu", "fp32", "strict").best_ms == 2.0


def test_a_half_type_note_is_no_doubt_under_a_half_precision():
    half_note = _result(Status.correct, 1.0, (("precision", "casts to a half type"),))
    assert precision_doubt(half_note, "bf16") is None
    assert precision_doubt(half_note, "fp32") == "precision: casts to a half type"
    other = _result(Status.correct, 1.0, (("precision", "casts to a half type"),
                                          ("precision", "compiles with fast-math")))
    assert precision_doubt(other, "fp16") == "precision: compiles with fast-math"
    assert precision_doubt(_result(Status.correct, 1.0, (("precision", "enables TF32 matmuls"),), fp64=True)) is None
    src = propose(_spec(EW_TASK), "cpu", 0, 0, [], numerics=Numerics(precision="fp16")).source
    fb = read_history([_attempt(1, src, half_note)], "cpu", "fp16")
    assert fb.best_ms == 1.0 and not fb.notes


# --------------------------------------------------------------------------------------
# real builds on the CPU
# --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("path", [EW_TASK, GN_TASK], ids=["elementwise", "groupnorm"])
def test_half_candidates_are_correct_in_the_sandbox(path, precision):
    """The proposal for an elementwise chain and for a chain ending in a GroupNorm, evaluated by
    the sandbox (a real build; the reference cast to the precision; KernelBench's tolerance)."""
    from sandbox.evaluate import evaluate

    numerics = Numerics(precision=precision)
    spec = with_device_sizes(_spec(path), "cpu")
    cand = propose(spec, "cpu", 0, 0, [], numerics=numerics)
    assert f"const {HALF[precision][0]}* __restrict__ in0" in cand.source
    cfg = EvalConfig(numerics=numerics, trials=2, warmup_runs=1, timed_runs=3, time_compile=False, profile=False)
    result = evaluate(spec, cand.source, "cpu", cfg)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    outputs = [o for t in result.trials for o in t.outputs]
    assert outputs and all(o.dtype == str(HALF[precision][2]).replace("torch.", "") for o in outputs)
    assert precision_doubt(result, precision) is None, result.flags


def _f64(values):
    return [v.double() if torch.is_tensor(v) and v.is_floating_point() else v for v in values]


@pytest.mark.slow
@pytest.mark.parametrize("precision,knobs", [("fp16", Knobs("max", True, 256, "onepass")),
                                             ("bf16", Knobs("max", False, 128, "twopass"))],
                         ids=["fp16-onepass-simd", "bf16-twopass-novec"])
def test_every_template_in_half_precision(precision, knobs):
    """The all-operators fixture (every fused operator, reduction and norm; odd sizes) in one
    build: each output within KernelBench's tolerance of the half-precision reference, or no
    farther from its float64 run than twice the reference's largest distance plus the tolerance;
    training-mode BatchNorm updates its half-precision running statistics like the reference."""
    from sandbox.harness import make_inputs, make_model

    numerics = Numerics(precision=precision)
    tol = numerics.tolerance.atol
    spec = with_device_sizes(read_spec(FIXTURES / "all_ops.py", name="fixtures/all_ops"), "cpu")
    cand = generate(spec, "cpu", knobs, numerics=numerics)
    assert cand.uncovered_ops == [] and f"const {HALF[precision][0]}* __restrict__ in0" in cand.source
    ns: dict = {"__name__": "kl_candidate_under_test"}
    exec(compile(cand.source, "candidate.py", "exec"), ns)
    task = load_task(spec)
    ref = make_model(task.Model, task, 5, "cpu", numerics)
    new = make_model(ns["ModelNew"], task, 5, "cpu", numerics)
    ref64 = copy.deepcopy(ref).double()
    problems = []
    for seed in (1, 2):
        inputs = make_inputs(task, seed, "cpu", numerics)
        with torch.no_grad(), numerics.enforced():
            r, n, r64 = ref(*[t.clone() for t in inputs]), new(*[t.clone() for t in inputs]), ref64(*_f64(inputs))
        for i, (a, b, c) in enumerate(zip(r, n, r64)):
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"seed {seed} output {i}: {b.dtype}{tuple(b.shape)} != {a.dtype}{tuple(a.shape)}")
                continue
            a, b = a.double(), b.double()
            near_ref = ((a - b).abs() <= tol + tol * a.abs()) | (a == b) | (a.isnan() & b.isnan())
            bound = 2.0 * float((a - c).abs().max()) + tol + tol * c.abs()
            if not bool((near_ref | ((b - c).abs() <= bound)).all()):
                problems.append(f"seed {seed} output {i}: max abs err {float((a - b).abs().max()):.3g}")
    for name in ("bn", "bn1d"):
        a, b = getattr(ref, name), getattr(new, name)
        assert b.running_mean.dtype == HALF[precision][2]
        assert torch.allclose(a.running_mean.float(), b.running_mean.float(), atol=tol, rtol=tol), name
        assert torch.allclose(a.running_var.float(), b.running_var.float(), atol=tol, rtol=tol), name
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------
# on a GPU
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_candidates_are_correct_on_cuda(precision):
    """Through the sandbox on the GPU: the elementwise seed with 8-byte vector loads, the
    GroupNorm seed with scalar loads and two-pass statistics."""
    from sandbox.evaluate import Sandbox

    numerics = Numerics(precision=precision)
    cfg = EvalConfig(numerics=numerics, trials=2, warmup_runs=1, timed_runs=5, time_compile=False)
    bad = []
    with Sandbox("cuda", cfg) as sandbox:
        for path, knobs in ((EW_TASK, Knobs()), (GN_TASK, Knobs(vec=False, reduce="twopass", block=128))):
            spec = _spec(path)
            cand = generate(spec, "cuda", knobs, numerics=numerics)
            assert ("KlVec4<" in cand.source) == knobs.vec
            result = sandbox.evaluate(spec, cand.source)
            if result.status is not Status.correct or precision_doubt(result, precision) is not None:
                bad.append(f"{path.stem} {knobs}: {result.status} {result.error_message} {result.flags}")
    assert not bad, "\n".join(bad)
