"""The critics on hand-built evidence (no builds): every cause category, the number check,
the llm critic's fallback and number flagging, and ``kernelloop critique`` on a store."""
from __future__ import annotations

import math
from typing import Any, Optional

import pytest

from agent.critic.base import get_critic
from agent.critic.grounded import (
    evidence_lines,
    fixed_arrays,
    pytorch_calls_in_forward,
    unstable_exp_sums,
)
from agent.critic.numbers import (
    check_text,
    evidence_figures,
    extract_quantities,
    fmt_ms,
    fmt_pct,
    fmt_x,
    sig,
)
from agent.critic.uncertainty import contradictions
from agent.types import AnalysisOut, AttemptView, Completion, DeviceFacts
from sandbox.result import (
    BuildInfo,
    EvalResult,
    Flag,
    FlagKind,
    KernelStat,
    OutputCheck,
    Status,
    Timing,
    Tolerance,
    Trial,
)
from sandbox.tasks import TaskSpec

GPU = DeviceFacts(device="cuda", name="NVIDIA H100 80GB HBM3", torch_version="2.5.1", compute_capability="9.0",
                  sm_count=132, bandwidth_gbps=3352.0, tflops={"fp32": 66.9, "tf32": 494.7})
CPU = DeviceFacts(device="cpu", name="AMD EPYC 7B13", torch_version="2.13.0")
TOL = Tolerance(atol=1e-4, rtol=1e-4)

LSE_TASK = TaskSpec(name="seeds/gemm_sigmoid_gemm_logsumexp", path="tasks/seeds/gemm_sigmoid_gemm_logsumexp.py",
                    source='''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.linear1 = nn.Linear(input_size, hidden_size)
        self.linear2 = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        x = torch.sigmoid(self.linear1(x))
        return torch.logsumexp(self.linear2(x), dim=1)

batch_size = 16384
input_size = 2048
hidden_size = 4096
output_size = 1024

def get_inputs():
    return [torch.randn(batch_size, input_size)]

def get_init_inputs():
    return [input_size, hidden_size, output_size]
''')

GN_TASK = TaskSpec(name="seeds/gemm_groupnorm_leakyrelu_sum", path="tasks/seeds/gemm_groupnorm_leakyrelu_sum.py",
                   source='''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, input_size, hidden_size, num_groups):
        super().__init__()
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size)

    def forward(self, x):
        x = torch.nn.functional.leaky_relu(self.gn(self.fc(x)))
        return x + x

batch_size = 128
input_size = 512
hidden_size = 256
num_groups = 8

def get_inputs():
    return [torch.randn(batch_size, input_size)]

def get_init_inputs():
    return [input_size, hidden_size, num_groups]
''')

UNSTABLE_LSE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = """
#include <torch/extension.h>

__global__ void lse_kernel(const float* x, float* out, int cols) {
    int row = blockIdx.x;
    float sum = 0.0f;
    for (int i = 0; i < cols; ++i) {
        sum += expf(x[row * cols + i]);
    }
    out[row] = logf(sum);
}
"""

class ModelNew(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.linear1 = nn.Linear(input_size, hidden_size)
        self.linear2 = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        x = torch.sigmoid(self.linear1(x))
        return ext.lse(self.linear2(x))
'''

STABLE_LSE = UNSTABLE_LSE.replace(
    """    float sum = 0.0f;
    for (int i = 0; i < cols; ++i) {
        sum += expf(x[row * cols + i]);
    }
    out[row] = logf(sum);""",
    """    float m = -INFINITY;
    for (int i = 0; i < cols; ++i) m = fmaxf(m, x[row * cols + i]);
    float sum = 0.0f;
    for (int i = 0; i < cols; ++i) {
        sum += expf(x[row * cols + i] - m);
    }
    out[row] = m + logf(sum);""")

FIXED_ARRAY = UNSTABLE_LSE.replace("""    int row = blockIdx.x;
    float sum = 0.0f;
    for (int i = 0; i < cols; ++i) {
        sum += expf(x[row * cols + i]);
    }
    out[row] = logf(sum);""", """    __shared__ float sdata[256];
    int row = blockIdx.x, t = threadIdx.x;
    float v = t < cols ? x[row * cols + t] : -INFINITY;
    sdata[t] = v;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (t < s) sdata[t] = fmaxf(sdata[t], sdata[t + s]);
        __syncthreads();
    }
    float m = sdata[0];
    __syncthreads();
    sdata[t] = expf(v - m);
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (t < s) sdata[t] += sdata[t + s];
        __syncthreads();
    }
    if (t == 0) out[row] = m + logf(sdata[0]);""")

# the same buffer as a per-thread reduction buffer over a strided loop: not a fixed-size bug
REDUCTION_BUFFER = UNSTABLE_LSE.replace("""    float sum = 0.0f;
    for (int i = 0; i < cols; ++i) {
        sum += expf(x[row * cols + i]);
    }
    out[row] = logf(sum);""", """    __shared__ float partial[256];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        sum += expf(x[row * cols + i] - 1.0f);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int k = 0; k < 256; ++k) t += partial[k];
        out[row] = logf(t) + 1.0f;
    }""")

GN_PER_THREAD_CUDA = '''import torch
from torch.utils.cpp_extension import load_inline

cuda_src = """
__global__ void gn_kernel(const float* x, const float* gamma, const float* beta, float* y,
                          int channels, int group_size, float eps) {
    int row = blockIdx.x;
    int t = threadIdx.x;
    float mean = 0.0f, sq = 0.0f;
    int count = 0;
    for (int i = t; i < group_size; i += blockDim.x) {
        float v = x[row * channels + i];
        mean += v; sq += v * v; ++count;
    }
    mean /= count;
    float var = sq / count - mean * mean;
    float inv_std = rsqrtf(var + eps);
    for (int i = t; i < group_size; i += blockDim.x) {
        float v = (x[row * channels + i] - mean) * inv_std * gamma[i] + beta[i];
        y[row * channels + i] = v;
    }
}
"""

class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.gn(x)
'''

PYTORCH_REWRITE = '''import torch
import torch.nn as nn
import torch.nn.functional as F

class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, divisor):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.inv = 1.0 / divisor

    def forward(self, x):
        x = self.conv(x)
        x.mul_(self.inv)
        return F.leaky_relu(x, negative_slope=0.01)
'''


# ----------------------------------------------------------------------------- builders

def timing(ms: float, clock: str = "cuda_event") -> Timing:
    return Timing(median_ms=ms, iqr_ms=ms * 0.021, mean_ms=ms * 1.003, min_ms=ms * 0.987, max_ms=ms * 1.07,
                  runs=20, clock=clock)


def trials_ok(n: int = 5) -> list[Trial]:
    return [Trial(index=i, candidate_first=i == 0, passed=True, outputs=[]) for i in range(n)]


def failed_trial(*outputs: OutputCheck, reason: str = "output 0 differs", passed_before: int = 0) -> list[Trial]:
    ts = [Trial(index=i, candidate_first=i == 0, passed=True, outputs=[]) for i in range(passed_before)]
    ts.append(Trial(index=passed_before, candidate_first=passed_before == 0, passed=False, reason=reason,
                    outputs=list(outputs)))
    return ts


def out(**kw: Any) -> OutputCheck:
    base = dict(index=0, shape=[16384], dtype="float32", ref_shape=[16384], ref_dtype="float32",
                numel=16384, tolerance=TOL)
    base.update(kw)
    return OutputCheck(**base)


REF_PROFILE = [KernelStat(name="ampere_sgemm_128x64_tn", count=2, total_us=2412.5, share=0.712),
               KernelStat(name="void at::native::sigmoid_kernel<float>", count=1, total_us=301.2, share=0.0889),
               KernelStat(name="void at::native::logsumexp_kernel<float>", count=1, total_us=674.8, share=0.1991)]


def result(status: str, **kw: Any) -> EvalResult:
    base: dict[str, Any] = dict(status=Status(status), task="t", device="cuda", device_name="NVIDIA H100 80GB HBM3",
                                torch_version="2.5.1", seconds=41.3)
    if status != "compile_error":
        base["build"] = BuildInfo(ok=True, seconds=23.4)
    base.update(kw)
    return EvalResult(**base)


def correct_result(cand: float = 2.9412, eager: float = 3.3887, compile_ms: Optional[float] = 3.1023,
                   profile: Optional[list[KernelStat]] = None, reference: Optional[list[KernelStat]] = REF_PROFILE,
                   floor: Optional[float] = 1.0311, **kw: Any) -> EvalResult:
    r = result("correct", trials=trials_ok(), candidate_time=timing(cand), eager_time=timing(eager),
               speedup_eager=eager / cand, custom_calls_per_forward=1.0, **kw)
    if compile_ms is not None:
        r.compile_time = timing(compile_ms)
        r.speedup_compile = compile_ms / cand
    if profile is None:
        profile = [KernelStat(name="ampere_sgemm_128x64_tn", count=2, total_us=2402.0, share=0.8123),
                   KernelStat(name="void at::native::sigmoid_kernel<float>", count=1, total_us=301.0, share=0.1018),
                   KernelStat(name="lse_kernel", count=1, total_us=254.0, share=0.0859, own=True)]
    r.profile = profile
    r.reference_profile = list(reference or [])
    if floor is not None:
        r.floor_ms = floor
        r.floor_fraction = floor / cand
    return r


def view(aid: int, res: Optional[EvalResult], source: Optional[str] = "", parse_status: str = "ok",
         rnd: int = 1, sample: int = 0, parse_error: Optional[str] = None) -> AttemptView:
    return AttemptView(attempt_id=aid, round=rnd, sample=sample, parse_status=parse_status, source=source,
                       result=res, parse_error=parse_error, evaluation_id=(100 + aid) if res is not None else None)


def analyze(attempts: list[AttemptView], task: TaskSpec = LSE_TASK, device: DeviceFacts = GPU) -> AnalysisOut:
    out_ = get_critic("grounded").analyze(task, attempts, device)
    assert_grounded(out_, attempts, device)
    return out_


def _stored(value: float, ev) -> bool:
    for f in ev.figures:
        if math.isclose(f.value, value, rel_tol=1e-9, abs_tol=1e-12):
            return True
        if f.dimension == "percent" and math.isclose(f.value, value * 100.0, rel_tol=1e-9, abs_tol=1e-9):
            return True
        if f.dimension == "time" and math.isclose(f.value, value * 1e3, rel_tol=1e-9):   # seconds fields
            return True
        if f.dimension == "time" and math.isclose(f.value, value / 1e3, rel_tol=1e-9):   # microsecond fields
            return True
        if f.dimension == "rate" and math.isclose(f.value, value * 1e12, rel_tol=1e-9):  # TFLOP/s
            return True
    return False


def assert_grounded(analysis: AnalysisOut, attempts: list[AttemptView], device: DeviceFacts) -> None:
    """Every number the grounded critic writes, and every figure its findings carry, is stored."""
    ev = evidence_figures(attempts, device)
    bad = check_text(analysis.markdown, ev, strict=True)
    assert not bad, f"numbers not in the evidence: {[str(q) + ' @ ' + q.context for q in bad]}\n{analysis.markdown}"
    for f in analysis.findings:
        bad = check_text(f.cause, ev, strict=True)
        assert not bad, (f.category, [str(q) for q in bad])
        for key, value in f.numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, int):
                continue    # counts, line numbers, sizes from the sources
            if not math.isfinite(value):
                continue
            assert _stored(value, ev), f"{f.category}.numbers[{key}]={value} is not a stored figure"


def cats(analysis: AnalysisOut, attempt_id: Optional[int] = None) -> list[str]:
    return [f.category for f in analysis.findings if attempt_id is None or f.attempt_id == attempt_id]


def cause(analysis: AnalysisOut, category: str) -> str:
    hits = [f.cause for f in analysis.findings if f.category == category]
    assert hits, f"no {category} finding in {cats(analysis)}"
    return hits[0]


def next_steps(analysis: AnalysisOut) -> list[str]:
    return [f.cause for f in analysis.findings if f.category == "next_step"]


# ----------------------------------------------------------------------------- answers without code

@pytest.mark.parametrize("status,category,word", [
    ("no_code", "no_code", "empty answer"),
    ("no_model_new", "no_model_new", "ModelNew"),
    ("truncated", "truncated", "cut off"),
    ("syntax_error", "syntax_error", "not valid Python"),
])
def test_answers_without_a_candidate(status, category, word):
    a = view(1, None, source=None if status == "no_code" else "class X: pass", parse_status=status,
             parse_error="invalid syntax (line 3)" if status == "syntax_error" else None)
    an = analyze([a])
    assert cats(an, 1) == [category]
    assert word.lower() in cause(an, category).lower()
    assert "no candidate" in an.markdown
    assert any("ModelNew" in s or "syntax" in s or "shorter" in s for s in next_steps(an))
    if status == "syntax_error":
        assert "invalid syntax (line 3)" in cause(an, category)


# ----------------------------------------------------------------------------- build and load

SRC_WITH_LOOP = "\n".join(["import torch"] * 23 + ["            for (; i < in; ++i) {"] + ["x"] * 5)


@pytest.mark.parametrize("message", [
    "/root/.cache/kernelloop/builds/kl_x/main.cpp:19:20: error: \u2018i\u2019 was not declared in this scope",
    '/root/.cache/kernelloop/builds/kl_x/cuda.cu(31): error: identifier "i" is undefined',
])
def test_compile_error_names_first_error_line_and_undeclared_variable(message):
    r = result("compile_error", build=BuildInfo(ok=False, seconds=31.2, first_error=message, first_error_line=24,
                                                log=message), error_type="RuntimeError", error_message=message)
    an = analyze([view(7, r, source=SRC_WITH_LOOP)])
    c = cause(an, "compile_error")
    assert "line 24" in c and "`i`" in c and "never declared" in c
    assert "for (; i < in; ++i) {" in c           # the candidate's line, quoted
    f = next(f for f in an.findings if f.category == "compile_error")
    assert f.numbers["first_error_line"] == 24
    steps = next_steps(an)
    assert any("fix the first compile error at line 24" in s and "declare `i`" in s for s in steps)
    assert "compile error at line 24" in an.markdown


def test_compile_error_without_a_line_quotes_the_log():
    log = "ninja: build stopped\nmain.cpp: fatal error: cuda_fp16.h: No such file or directory\n"
    r = result("compile_error", build=BuildInfo(ok=False, seconds=3.0, log=log))
    an = analyze([view(2, r, source="x")])
    c = cause(an, "compile_error")
    assert "cuda_fp16.h: No such file or directory" in c
    assert "line" not in c.split("first compiler error")[0]


def test_load_error_undefined_symbol():
    msg = "/tmp/kl_ab.so: undefined symbol: _Z12fused_kernelN2at6TensorE"
    an = analyze([view(3, result("load_error", error_type="ImportError", error_message=msg))])
    c = cause(an, "load_error")
    assert "undefined symbol" in c and "never defined" in c
    assert any("define every function" in s for s in next_steps(an))


# ----------------------------------------------------------------------------- runtime errors and timeouts

@pytest.mark.parametrize("error_type,message,kind", [
    ("RuntimeError", "CUDA error: an illegal memory access was encountered", "illegal memory access"),
    ("RuntimeError", "CUDA error: misaligned address", "misaligned address"),
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", "out of memory"),
    ("RuntimeError", "CUDA error: unspecified launch failure", "unspecified launch failure"),
    ("RuntimeError", "CUDA error: invalid configuration argument", "invalid launch configuration"),
    ("RuntimeError", "CUDA error: too many resources requested for launch", "too many resources"),
    ("WorkerDied", "the candidate worker killed by signal SIGSEGV before answering", "segmentation fault"),
    ("RuntimeError", "The size of tensor a (128) must match the size of tensor b (64) at dimension 1",
     "shape error"),
])
def test_runtime_error_kinds(error_type, message, kind):
    r = result("runtime_error", error_type=error_type, error_message=message,
               trials=[Trial(index=0, candidate_first=True, passed=False, reason=f"{error_type}: {message}")])
    an = analyze([view(4, r, source="x")])
    c = cause(an, "runtime_error")
    assert kind in c
    f = next(f for f in an.findings if f.category == "runtime_error")
    assert f.numbers["error_kind"].startswith(kind.split()[0])
    assert any(kind in s for s in next_steps(an))


def test_illegal_access_with_a_fixed_array_smaller_than_the_task():
    r = result("runtime_error", error_type="RuntimeError",
               error_message="CUDA error: an illegal memory access was encountered")
    an = analyze([view(4, r, source=FIXED_ARRAY)])
    assert "fixed_size_array" in cats(an, 4)


def test_unknown_runtime_error_is_quoted():
    r = result("runtime_error", error_type="ValueError", error_message="something odd happened")
    an = analyze([view(4, r, source="x")])
    assert "something odd happened" in cause(an, "runtime_error")


def test_timeouts_say_which_limit():
    run = result("timeout", error_type="Timeout", error_message="the candidate worker did not answer within 300 s")
    build = result("timeout", build=BuildInfo(ok=False, seconds=600.2), error_type="BuildTimeout",
                   error_message="building the candidate took longer than 600 s")
    an = analyze([view(1, run, source="x"), view(2, build, source="y", sample=1)])
    causes = [f.cause for f in an.findings if f.category == "timeout"]
    assert "while running" in causes[0] and "300 s" in causes[0]
    assert "while building" in causes[1] and "600 s" in causes[1]


# ----------------------------------------------------------------------------- incorrect outputs

def test_wrong_shape_and_dtype():
    shape = result("incorrect", trials=failed_trial(out(shape=[16384, 1], ref_shape=[16384]),
                                                    reason="output 0 has shape (16384, 1), the reference (16384,)"))
    dtype = result("incorrect", trials=failed_trial(out(dtype="float16", ref_dtype="float32")))
    an = analyze([view(1, shape, source="x"), view(2, dtype, source="y", sample=1)])
    assert "wrong_shape" in cats(an, 1) and "[16384, 1]" in cause(an, "wrong_shape")
    assert "wrong_dtype" in cats(an, 2) and "float16" in cause(an, "wrong_dtype")
    assert any("keepdim" in s for s in next_steps(an))


def test_inf_where_reference_is_finite_with_exp_without_max_is_overflow():
    r = result("incorrect", trials=failed_trial(out(inf_count=16384, mismatched=16384, max_abs_err=float("inf"),
                                                    max_rel_err=float("inf"), mismatch_pattern="everywhere",
                                                    bad_rows=[0, 1, 2])))
    an = analyze([view(5, r, source=UNSTABLE_LSE)])
    c = cause(an, "nan_inf")
    assert "16384 Inf" in c and "overflow" in c and "maximum" in c
    assert "overflow" in cats(an, 5)
    assert "latent_overflow" not in cats(an)
    assert any("subtract the row maximum" in s for s in next_steps(an))
    assert "100%" in c           # 16384 of 16384 elements


def test_nan_without_an_exp_sum_does_not_blame_overflow():
    r = result("incorrect", trials=failed_trial(out(nan_count=12, mismatched=12, max_abs_err=float("inf"),
                                                    mismatch_pattern="scattered")))
    an = analyze([view(5, r, source=STABLE_LSE)])
    c = cause(an, "nan_inf")
    assert "12 NaN" in c and "overflow" not in c
    assert "overflow" not in cats(an)


@pytest.mark.parametrize("pattern,words", [
    ("everywhere", "everywhere"),
    ("some_rows", "only in some rows"),
    ("tile_edges", "tile edges"),
    ("scattered", "scattered"),
])
def test_mismatch_patterns(pattern, words):
    o = out(shape=[128, 1024], ref_shape=[128, 1024], numel=131072, mismatched=8190, max_abs_err=0.7532,
            max_rel_err=3.1417, mismatch_pattern=pattern, bad_rows=[3, 17, 64])
    an = analyze([view(6, result("incorrect", trials=failed_trial(o, passed_before=2)), source="x")])
    c = cause(an, "mismatch")
    assert words in c
    assert "8190 of 131072" in c and "0.753" in c and "3.14" in c and "6.25%" in c
    f = next(f for f in an.findings if f.category == "mismatch")
    assert f.numbers["max_abs_err"] == 0.7532 and f.numbers["mismatch_pattern"] == pattern
    assert "1 of 3 trials failed" in an.markdown and "the others passed" in an.markdown


def test_small_errors_point_at_precision_not_logic():
    o = out(mismatched=3, max_abs_err=2.7e-4, max_rel_err=1.1e-3, mismatch_pattern="scattered")
    an = analyze([view(6, result("incorrect", trials=failed_trial(o)), source="x")])
    assert "summation order or reduced precision" in cause(an, "mismatch")


def test_fixed_size_array_smaller_than_the_task_dimension():
    o = out(mismatched=16384, max_abs_err=1.3863, max_rel_err=0.2012, mismatch_pattern="everywhere")
    an = analyze([view(8, result("incorrect", trials=failed_trial(o)), source=FIXED_ARRAY)])
    c = cause(an, "fixed_size_array")
    assert "sdata[256]" in c and "`output_size` = 1024" in c
    assert any("instead of a fixed 256 entries" in s for s in next_steps(an))


def test_fixed_array_not_mentioned_for_a_correct_attempt_or_a_reduction_buffer():
    an = analyze([view(8, correct_result(), source=FIXED_ARRAY)])
    assert "fixed_size_array" not in cats(an)
    o = out(mismatched=16384, max_abs_err=1.3863, max_rel_err=0.2012, mismatch_pattern="everywhere")
    an = analyze([view(8, result("incorrect", trials=failed_trial(o)), source=REDUCTION_BUFFER)])
    assert "fixed_size_array" not in cats(an)
    assert [a.strided for a in fixed_arrays(REDUCTION_BUFFER)] == [True]


def test_group_norm_statistics_per_thread():
    o = out(shape=[128, 256], ref_shape=[128, 256], numel=32768, mismatched=32700, max_abs_err=2.4453,
            max_rel_err=17.5, mismatch_pattern="everywhere")
    an = analyze([view(9, result("incorrect", trials=failed_trial(o)), source=GN_PER_THREAD_CUDA)], task=GN_TASK)
    c = cause(an, "group_stats")
    assert "never combine values across threads" in c and "per (sample, group)" in c
    assert any("compute the group statistics per group" in s for s in next_steps(an))


def test_group_stats_hypothesis_for_cpu_code_and_none_for_other_tasks():
    cpu_src = GN_PER_THREAD_CUDA.replace("__global__ void gn_kernel", "void gn_kernel") \
        .replace("rsqrtf", "1.0f / std::sqrt").replace("threadIdx.x", "0").replace("blockIdx.x", "0") \
        .replace("blockDim.x", "32")
    o = out(shape=[128, 256], ref_shape=[128, 256], numel=32768, mismatched=32700, max_abs_err=2.4453,
            mismatch_pattern="everywhere")
    an = analyze([view(9, result("incorrect", trials=failed_trial(o)), source=cpu_src)], task=GN_TASK, device=CPU)
    assert "per group" in cause(an, "group_stats")
    an2 = analyze([view(9, result("incorrect", trials=failed_trial(o)), source=cpu_src)], task=LSE_TASK)
    assert "group_stats" not in cats(an2)


def test_inputs_mutated_flag_on_an_incorrect_attempt():
    reason = "the candidate changed its input(s) [0]"
    r = result("incorrect", trials=[Trial(index=0, candidate_first=True, passed=False, reason=reason)],
               flags=[Flag(kind=FlagKind.inputs_mutated, reason=reason)])
    an = analyze([view(3, r, source="x")])
    assert "inputs_mutated" in cats(an, 3)
    assert reason in cause(an, "incorrect")
    assert "inputs mutated" in an.markdown


# ----------------------------------------------------------------------------- correct attempts

def test_correct_partial_fusion_is_called_correct_and_explained_from_profiles():
    r = correct_result()
    an = analyze([view(11, r, source=STABLE_LSE)])
    assert cats(an, 11)[:3] == ["correct", "faster", "partial_fusion"]
    assert "### Attempt 11 (round 1, sample 0): correct\n" in an.markdown
    assert "not make it incorrect" in cause(an, "partial_fusion")
    c = cause(an, "correct")
    assert fmt_ms(2.9412) in c and fmt_ms(3.3887) in c and fmt_x(3.3887 / 2.9412) in c and fmt_x(3.1023 / 2.9412) in c
    why = cause(an, "faster")
    assert "logsumexp_kernel" in why and "no longer run" in why           # removed reference kernel
    assert fmt_pct(0.0859) in why                                          # own kernel's share
    assert "ampere_sgemm_128x64_tn" in why and fmt_pct(0.8123 + 0.1018) in why   # still running
    assert "roofline floor (1.03 ms) is 35.1% of its runtime" in an.markdown
    f = next(f for f in an.findings if f.category == "faster")
    assert f.numbers["own_share"] == pytest.approx(0.0859)
    # next attempt: keep the fused kernel, fuse the elementwise kernel left, not the library GEMM
    first = next_steps(an)[0]
    assert first.startswith("Start from attempt 11") and "sigmoid_kernel" in first and "library GEMM" in first
    # the table shows each speedup with its interval (from the quartiles: no per-run times here)
    assert "| 11 | 1 | correct | 2.94 ms | 1.15x [1.13x-1.18x] | 1.05x [1.03x-1.08x] |" in an.markdown


def test_correct_slower_than_eager_says_so_with_its_evidence():
    prof = [KernelStat(name="ampere_sgemm_128x64_tn", count=2, total_us=2402.0, share=0.6113),
            KernelStat(name="void at::native::sigmoid_kernel<float>", count=1, total_us=301.0, share=0.0766),
            KernelStat(name="lse_kernel", count=1, total_us=1100.0, share=0.2799, own=True),
            KernelStat(name="void at::native::copy_kernel<float>", count=1, total_us=126.0, share=0.0321)]
    r = correct_result(cand=3.9290, eager=3.3887, profile=prof)
    an = analyze([view(12, r, source=STABLE_LSE)])
    assert "slower" in cats(an, 12)
    why = cause(an, "slower")
    assert fmt_x(3.3887 / 3.9290) in why and "27.99%" in why or "28.0%" in why
    assert "copy_kernel" in an.markdown and "new work the reference does not do" in an.markdown


def test_a_difference_within_the_spread_is_no_speedup():
    r = correct_result(cand=3.3801, eager=3.3887)                 # 1.00x
    an = analyze([view(12, r, source=STABLE_LSE)])
    assert "inconclusive" in cats(an, 12) and "faster" not in cats(an, 12)
    assert cause(an, "inconclusive").startswith("Inconclusive against eager PyTorch: the point estimate is 1.00x")
    assert "too close for these runs to tell apart" in cause(an, "inconclusive")
    r = correct_result(cand=3.0, eager=3.3887)                    # 1.13x, but the candidate's IQR is 1 ms
    r.candidate_time = r.candidate_time.model_copy(update={"iqr_ms": 1.0})
    an = analyze([view(12, r, source=STABLE_LSE)])
    c = cause(an, "inconclusive")
    assert "faster" not in cats(an, 12) and "point estimate is 1.13x" in c
    assert "the candidate's runs spread widely (IQR 1.00 ms around a median of 3.00 ms" in c


def test_a_speed_label_never_contradicts_its_interval():
    """The issue's miss: a noisy 0.21x and a noisy 2.23x were both called "no difference"."""
    from sandbox.timing import summarize

    def timed(samples):
        return summarize(samples, "perf_counter").model_copy(update={"host_load": 2.5})

    for eager, cand, label in (([5.24] * 10 + [40.0] * 10, [24.7] * 20, "inconclusive"),
                               ([10.0 + 0.01 * i for i in range(20)], [4.4 + 0.01 * i for i in range(20)], "faster"),
                               ([10.0 + 0.01 * i for i in range(20)], [20.0 + 0.01 * i for i in range(20)], "slower")):
        r = correct_result()
        r.eager_time, r.candidate_time = timed(eager), timed(cand)
        r.speedup_eager = r.eager_time.median_ms / r.candidate_time.median_ms
        r.compile_time = r.speedup_compile = None
        an = analyze([view(14, r, source=STABLE_LSE)])
        assert label in cats(an, 14)
        f = next(f for f in an.findings if f.category == label)
        assert (f.numbers["interval_low"] > 1.0) == (label == "faster")
        assert (f.numbers["interval_high"] < 1.0) == (label == "slower")
        assert contradictions(an.markdown) == []
        if label == "inconclusive":
            assert "host was busy while timing (load 2.50 per CPU)" in f.cause


def test_latent_overflow_in_a_correct_attempt():
    an = analyze([view(13, correct_result(), source=UNSTABLE_LSE)])
    c = cause(an, "latent_overflow")
    assert "Latent overflow risk" in c and "these inputs stay small enough" in c and "lse_kernel" in c
    assert "nan_inf" not in cats(an)
    assert "correct" in cats(an, 13)
    assert any("subtract the row maximum" in s for s in next_steps(an))
    assert "latent overflow risk" in an.markdown


def test_static_exp_checks_are_conservative():
    assert unstable_exp_sums(UNSTABLE_LSE)[0].function == "lse_kernel"
    assert unstable_exp_sums(STABLE_LSE) == []
    sigmoid = UNSTABLE_LSE.replace("sum += expf(x[row * cols + i]);", "out[i] = 1.0f / (1.0f + expf(-x[i]));")
    assert unstable_exp_sums(sigmoid) == []
    two_step = UNSTABLE_LSE.replace("sum += expf(x[row * cols + i]);",
                                    "float e = __expf(x[row * cols + i]);\n        sum += e;")
    assert unstable_exp_sums(two_step)[0].line == 12
    commented = UNSTABLE_LSE.replace("    float sum = 0.0f;\n", "    // the max was folded in upstream\n    float sum = 0.0f;\n")
    assert unstable_exp_sums(commented)           # a comment is not code
    assert unstable_exp_sums(None) == [] and unstable_exp_sums("") == []


def test_fixed_arrays_and_forward_calls_are_read_from_the_source():
    arrays = fixed_arrays(FIXED_ARRAY.replace("sdata[256]", "sdata[BLOCK]").replace(
        "#include <torch/extension.h>", "#include <torch/extension.h>\n#define BLOCK 256"))
    assert [(a.name, a.size, a.shared) for a in arrays] == [("sdata", 256, True)]
    assert pytorch_calls_in_forward(PYTORCH_REWRITE) == ["nn.Conv2d", "Tensor.mul_", "F.leaky_relu"]


def test_pytorch_rewrite_is_flagged_and_never_the_best():
    reason = "no call into the candidate's own compiled extension during a forward"
    prof = [KernelStat(name="aten::mkldnn_convolution", count=1, total_us=4521.0, share=0.994)]
    r = correct_result(cand=4.5, eager=4.6, compile_ms=None, profile=prof, reference=prof, floor=None,
                       flags=[Flag(kind=FlagKind.no_custom_kernel, reason=reason)])
    r.custom_calls_per_forward = 0.0
    an = analyze([view(14, r, source=PYTORCH_REWRITE)], device=CPU)
    c = cause(an, "no_custom_kernel")
    assert "PyTorch rewrite" in c and "`nn.Conv2d`" in c
    assert "best" not in cats(an)
    assert "correct (flagged: no custom kernel)" in an.markdown
    assert "partial_fusion" not in cats(an)
    assert any("write the fused operation as a kernel" in s for s in next_steps(an))


def test_gpu_profiles_short_names_and_extension_ranges():
    """cuda profiles hold demangled template names and, beside the candidate's kernels, the
    range recorded around each call into its extension: shown short, counted once."""
    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BUnaryFunctor<float, float, float, "
           "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, at::native::"
           "BUnaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul>)")
    leaky = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::leaky_relu_kernel("
             "at::TensorIteratorBase&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda(float)#1}, "
             "std::array<char*, 2ul> >(int, float)")
    conv = "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsize2x2x1_cudnn"
    ref = [KernelStat(name=conv, count=1, total_us=1540.7, share=0.5623),
           KernelStat(name=mul, count=1, total_us=489.3, share=0.1786),
           KernelStat(name=leaky, count=1, total_us=488.4, share=0.1782)]
    prof = [KernelStat(name=conv, count=1, total_us=1540.7, share=0.4132),
            KernelStat(name="div_leaky_relu_vec4_kernel(float4*, long, float, float)", count=1, total_us=528.4,
                       share=0.1417, own=True),
            KernelStat(name="kernelloop_ext::div_leaky_relu_", count=1, total_us=528.4, share=0.1417, own=True)]
    r = correct_result(cand=3.2213, eager=3.6731, compile_ms=None, profile=prof, reference=ref, floor=None)
    an = analyze([view(21, r, source=PYTORCH_REWRITE)])
    md = an.markdown
    assert "`vectorized_elementwise_kernel<MulFunctor>` (17.9%)" in md
    assert "`vectorized_elementwise_kernel<leaky_relu_kernel>` (17.8%)" in md
    assert "its own kernels: `div_leaky_relu_vec4_kernel` (14.2%) of its time, 528 us in its profile" in md
    assert "kernelloop_ext::div_leaky_relu_" not in md                     # the range is not a second kernel
    assert "978 us" in md and "do not account" not in md                  # 528 us replace 978 us: consistent
    assert "library GEMM/convolution" in next_steps(an)[0]


def test_a_suspicious_timing_keeps_the_partial_fusion_verdict_but_not_best():
    r = correct_result(flags=[Flag(kind=FlagKind.suspicious, reason="the parent's clock saw 2010.0 ms")])
    an = analyze([view(23, r, source=STABLE_LSE)])
    assert {"correct", "partial_fusion", "suspicious"} <= set(cats(an, 23)) and "best" not in cats(an)


def test_repeated_flag_kinds_are_merged():
    r = correct_result(flags=[Flag(kind=FlagKind.no_custom_kernel, reason="no call into the extension"),
                              Flag(kind=FlagKind.no_custom_kernel, reason="the profiler shows no kernel of its own"),
                              Flag(kind=FlagKind.suspicious, reason="the parent's clock saw 2001.0 ms")])
    an = analyze([view(22, r, source=PYTORCH_REWRITE)])
    assert cats(an, 22).count("no_custom_kernel") == 1
    assert "(flagged: no custom kernel, suspicious)" in an.markdown
    c = cause(an, "no_custom_kernel")
    assert "no call into the extension; the profiler shows no kernel of its own" in c
    assert any("flagged suspicious" in s for s in next_steps(an))


@pytest.mark.parametrize("kind,words", [
    ("fallback", "path back to PyTorch"),
    ("precision", "asks for a narrower format"),
    ("inaccurate", "less accurate than the float32 reference"),
    ("suspicious", "not to be trusted"),
    ("impossible", "faster than the roofline floor allows"),
])
def test_flags(kind, words):
    r = correct_result(flags=[Flag(kind=FlagKind(kind), reason=f"reason for {kind}")])
    an = analyze([view(15, r, source=STABLE_LSE)])
    c = cause(an, kind)
    assert words in c and f"reason for {kind}" in c
    if kind == "precision":
        assert "best" in cats(an)                  # precision alone does not disqualify
    else:
        assert "best" not in cats(an)


def test_boundness_only_from_stored_flop_and_byte_counts():
    an = analyze([view(16, correct_result(), source=STABLE_LSE)])
    assert "bound" not in an.markdown                  # no FLOP/byte counts stored: nothing said
    # floor 1.0311 ms; 3.4562e9 bytes at 3352 GB/s take 1.0311 ms: the memory term is the floor
    memory = correct_result(floor_flops=3.3e9, floor_bytes=3.4562e9)
    compute = correct_result(floor_flops=2.749e11, floor_bytes=1.612e8)
    an = analyze([view(16, memory, source=STABLE_LSE)])
    assert "the floor is memory-bound" in an.markdown and "3.46e+09 bytes at the device's 3352 GB/s" in an.markdown
    an = analyze([view(17, compute, source=STABLE_LSE)])
    assert "the floor is compute-bound" in an.markdown and "2.75e+11 FLOP" in an.markdown
    no_probe = get_critic("grounded").analyze(LSE_TASK, [view(17, compute)], CPU)
    assert "bound" not in no_probe.markdown
    other_probe = DeviceFacts(device="cuda", name="x", torch_version="2.5.1", bandwidth_gbps=1000.0)
    assert "bound" not in get_critic("grounded").analyze(LSE_TASK, [view(17, memory)], other_probe).markdown


# ----------------------------------------------------------------------------- the whole analysis

def mixed_attempts() -> list[AttemptView]:
    msg = '/x/cuda.cu(31): error: identifier "i" is undefined'
    o_inf = out(inf_count=300, mismatched=300, max_abs_err=float("inf"), mismatch_pattern="some_rows",
                bad_rows=[2, 9])
    return [
        view(1, None, source=None, parse_status="no_code"),
        view(2, result("compile_error", build=BuildInfo(ok=False, seconds=31.2, first_error=msg, first_error_line=24)),
             source=SRC_WITH_LOOP, sample=1),
        view(3, correct_result(), source=UNSTABLE_LSE, rnd=2),
        view(4, result("incorrect", trials=failed_trial(o_inf)), source=UNSTABLE_LSE, rnd=2, sample=1),
        view(5, correct_result(cand=2.5001, eager=3.3887, compile_ms=3.1023), source=STABLE_LSE, rnd=3),
    ]


def test_comparison_table_summary_and_next_steps():
    attempts = mixed_attempts()
    an = analyze(attempts)
    md = an.markdown
    for section in ("## Attempts", "## Comparison", "## What the next attempt should change"):
        assert section in md
    assert "| attempt | round | verdict | runtime | vs eager | vs torch.compile | cause |" in md
    assert "Best: attempt 5, 2.50 ms" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| attempt")]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2", "3", "4", "5"]
    steps = next_steps(an)
    assert steps[0].startswith("Start from attempt 5")
    merged = [s for s in steps if "subtract the row maximum" in s]
    assert len(merged) == 1 and merged[0].startswith("Attempts 3 and 4")
    best = next(f for f in an.findings if f.category == "best")
    assert best.attempt_id == 5 and best.numbers["median_ms"] == 2.5001
    # faster-than ratio between two correct attempts is a documented derivation
    ev = evidence_figures(attempts, GPU)
    assert not check_text("attempt 5 is 1.18x faster than attempt 3", ev)


def test_findings_serialise_and_are_deterministic():
    a = get_critic("grounded").analyze(LSE_TASK, mixed_attempts(), GPU)
    b = get_critic("grounded").analyze(LSE_TASK, list(reversed(mixed_attempts())), GPU)
    assert a.markdown == b.markdown
    assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
    import json
    json.dumps([f.to_dict() for f in a.findings if all(
        not (isinstance(v, float) and not math.isfinite(v)) for v in f.numbers.values())])


def test_no_correct_attempt_says_so():
    an = analyze([view(1, None, source=None, parse_status="no_code")])
    assert "No attempt is correct yet" in an.markdown


def test_evidence_lines_quote_stored_figures_only():
    attempts = mixed_attempts()
    ev = evidence_figures(attempts, GPU)
    for a in attempts:
        for line in evidence_lines(a):
            assert not check_text(line, ev, strict=True), line


# ----------------------------------------------------------------------------- the number check

def test_extraction_units_and_code_spans():
    qs = extract_quantities("took 0.312 ms (1.23x) with 45.2% in `kernel<4>` and 3.05e-01 error; "
                            "a 3 x 3 conv, float4, sm_90, 2.0 TB/s, 60 TFLOP/s, 68 billion FLOPs, 268 MB, 12 us\n"
                            "```\nint x = 256; // 12.5 ms\n```\n")
    got = [(q.text, q.unit, q.dimension) for q in qs]
    assert ("0.312", "ms", "time") in got and ("1.23", "x", "ratio") in got and ("45.2", "%", "percent") in got
    assert ("2.0", "TB/s", "bandwidth") in got and ("60", "TFLOP/s", "rate") in got
    assert ("68", "FLOPs", "flops") in got and ("268", "MB", "bytes") in got and ("12", "us", "time") in got
    assert not any(q.text in ("4", "90", "12.5", "256") for q in qs)
    assert [q.text for q in qs if q.text == "3"] == ["3", "3"]       # "3 x 3" is no speedup


def test_units_must_match_the_stored_figure():
    attempts = [view(1, correct_result(cand=30.8, eager=35.42, compile_ms=None, floor=None))]
    ev = evidence_figures(attempts, GPU)
    assert check_text("runs in 30.8 ms", ev) == []
    assert check_text("runs in 30800 us", ev) == []
    assert [str(q) for q in check_text("runs in 30.8 seconds", ev)] == ["30.8 seconds"]
    assert check_text("a 1.15x speedup", ev) == []
    assert [q.text for q in check_text("a 1.5x speedup", ev)] == ["1.5"]
    assert [q.unit for q in check_text("a 137-GFLOP GEMM moving 268 MB", ev)] == ["GFLOP", "MB"]
    assert [q.text for q in check_text("~20-25 ms possible", ev)] == ["20", "25"]
    # rounding: the quoted digits must round from the stored value
    assert check_text("31 ms", ev) == [] and check_text("30.80 ms", ev) == []
    assert check_text("30800 us", ev) == [] and check_text("30 ms", ev) == []   # trailing zeros: not significant
    assert check_text("50 ms", ev) != []
    assert check_text("31.5 ms", ev) != []
    # shares of a profile as percentages; unitless integers are never checked
    assert check_text("the GEMM takes 81.2% of its time", ev) == []
    assert check_text("attempt 1 at line 24 with 256 threads", ev, strict=True) == []
    assert [q.text for q in check_text("max error 0.125", ev, strict=True)] == ["0.125"]


def test_device_ceilings_are_evidence():
    ev = evidence_figures([], GPU)
    assert check_text("3352 GB/s and 66.9 TFLOP/s", ev) == []
    assert check_text("3.35 TB/s", ev) == []
    assert check_text("989 TFLOPS", ev) != []


def test_formatters_round_to_what_they_print():
    assert sig(9.996) == "10.0" and sig(0.00012345) == "0.000123" and sig(1234.5) == "1234"
    assert fmt_pct(0.4523) == "45.2%" and fmt_pct(1.0) == "100%" and fmt_ms(0.181234) == "0.181 ms"


# ----------------------------------------------------------------------------- the llm critic

class FakeBackend:
    """Answers ``text`` (or, call by call, the entries of ``texts``)."""
    name = "openai:fake"

    def __init__(self, text: str = "", error: Optional[str] = None, raise_exc: bool = False,
                 texts: Optional[list[str]] = None):
        self.text, self.error, self.raise_exc, self.texts = text, error, raise_exc, list(texts or [])
        self.seen: list[list[dict[str, str]]] = []

    def chat(self, messages: list[dict[str, str]], purpose: str = "critique") -> Completion:
        self.seen.append(messages)
        if self.raise_exc:
            raise ConnectionError("endpoint unreachable")
        text = self.texts.pop(0) if self.texts else self.text
        return Completion(text=text if self.error is None else "", model=self.name, finish_reason="stop",
                          prompt_tokens=1000, completion_tokens=200, error=self.error)


LLM_TEXT = """<think>let me think about 99 ms</think>
## Attempts
Attempt 5 is correct at 2.50 ms, 1.36x faster than eager (3.39 ms). Attempt 3 runs in 2.94 ms.
Attempt 2 fails to compile at line 24. The GEMM is a 137-GFLOP memory-bound op taking 30.8 seconds.
A fully fused kernel would reach ~1.2 ms.
"""


def test_llm_critic_prompt_and_number_check():
    backend = FakeBackend(text=LLM_TEXT)
    critic = get_critic("llm", backend=backend)
    attempts = mixed_attempts()
    an = critic.analyze(LSE_TASK, attempts, GPU)
    assert an.critic == "llm" and an.template == "critic_task" and an.completion.text == LLM_TEXT
    system, user = an.messages[:2]
    assert system["role"] == "system" and "30.8 ms is never \"30.8 seconds\"" in system["content"]
    u = user["content"]
    assert "class Model(nn.Module)" in u                      # the task
    assert "sum += expf(x[row * cols + i]);" in u             # an attempt's code
    assert "status: compile_error" in u and "at line 24 of the candidate" in u   # its evidence
    assert "runtime: median 2.50 ms" in u
    assert "[latent_overflow]" in u                           # grounded findings
    # the unverified numbers sent it back once; its second answer (the same here) is kept, flagged
    assert len(backend.seen) == 2 and backend.seen[0] == an.messages[:2] and backend.seen[1] == an.messages
    assert an.messages[2] == {"role": "assistant", "content": LLM_TEXT.split("</think>")[1].strip()}
    assert "30.8 seconds" in an.messages[3]["content"] and "matches no stored figure" in an.messages[3]["content"]
    assert an.completion.prompt_tokens == 2000 and "regenerated" in cats(an)
    md = an.markdown
    assert "<think>" not in md and "99 ms" not in md.split("## Numbers not found")[0]
    assert "## Numbers not found in the evidence" in md
    flagged = md.split("## Numbers not found in the evidence")[1]
    for bad in ("137 GFLOP", "30.8 seconds", "1.2 ms"):
        assert bad in flagged
    for good in ("2.50 ms", "1.36x", "3.39 ms", "2.94 ms"):
        assert good not in flagged
    unverified = [f for f in an.findings if f.category == "unverified_number"]
    assert {f.numbers["unit"] for f in unverified} == {"GFLOP", "seconds", "ms"}
    assert "latent_overflow" in cats(an)                      # grounded findings carried over


def test_llm_critic_regenerates_once_and_keeps_a_corrected_answer():
    wrong = "Attempt 5 is correct at 2.50 ms, 1.36x vs eager; a fused kernel would take 1.2 ms."
    right = "Attempt 5 is correct at 2.50 ms, 1.36x vs eager."
    backend = FakeBackend(texts=[wrong, right])
    an = get_critic("llm", backend=backend).analyze(LSE_TASK, mixed_attempts(), GPU)
    assert len(backend.seen) == 2 and an.markdown.strip() == right
    assert "unverified_number" not in cats(an) and "Numbers not found" not in an.markdown
    regen = next(f for f in an.findings if f.category == "regenerated")
    assert "1 statement(s)" in regen.cause and any("1.2 ms" in e for e in regen.evidence)


def test_llm_critic_flags_a_speed_label_its_interval_contradicts():
    an = get_critic("llm", backend=FakeBackend(
        text="Attempt 5 is Slower than eager PyTorch: 1.36x (95% interval 1.13x-1.18x).")).analyze(
        LSE_TASK, mixed_attempts(), GPU)
    assert "contradicted_speed" in cats(an) and "## Speed labels contradicted by their intervals" in an.markdown


def test_llm_prompt_carries_patterns_and_intervals():
    backend = FakeBackend(text="ok")
    get_critic("llm", backend=backend).analyze(LSE_TASK, mixed_attempts(), GPU)
    u = backend.seen[0][1]["content"]
    assert "Speed, with its 95% interval" in u and "[faster] Faster than eager PyTorch: 1.36x (95% interval" in u


def test_llm_critic_clean_text_has_no_unverified_section():
    an = get_critic("llm", backend=FakeBackend(text="Attempt 5: 2.50 ms, 1.36x vs eager.")).analyze(
        LSE_TASK, mixed_attempts(), GPU)
    assert "Numbers not found" not in an.markdown
    assert "unverified_number" not in cats(an)


@pytest.mark.parametrize("backend", [FakeBackend(error="HTTP 429: quota exceeded (gave up after 4 tries)"),
                                     FakeBackend(raise_exc=True), FakeBackend(text="  ")])
def test_llm_critic_falls_back_to_grounded(backend):
    attempts = mixed_attempts()
    an = get_critic("llm", backend=backend).analyze(LSE_TASK, attempts, GPU)
    grounded = get_critic("grounded").analyze(LSE_TASK, attempts, GPU)
    assert an.critic == "grounded"
    assert an.markdown.startswith("> The language-model critic (openai:fake) failed")
    assert an.markdown.endswith(grounded.markdown)
    assert an.completion is not None and an.messages is not None and an.template == "critic_task"
    assert "llm_failed" in cats(an)


def test_llm_critic_needs_a_backend():
    with pytest.raises(ValueError):
        get_critic("llm")
    with pytest.raises(ValueError):
        get_critic("nope")


def test_llm_prompt_caps_code():
    long_src = UNSTABLE_LSE + "\n".join(f"# filler line {i}" for i in range(3000))
    critic = get_critic("llm", backend=FakeBackend(text="ok"), max_code_chars=2000)
    msgs = critic.messages(LSE_TASK, [view(1, correct_result(), source=long_src)], GPU)
    assert "characters cut" in msgs[1]["content"]
    assert len(msgs[1]["content"]) < 12000


# ----------------------------------------------------------------------------- the store and the command

@pytest.fixture
def store(tmp_path):
    from store import Store

    s = Store(tmp_path / "critic.db")
    yield s
    s.close()


def _fill(store, model: str = "openai:fake", critic: str = "llm") -> dict[str, int]:
    from store.models import Attempt, DeviceProbe, Run
    from store.repo import evaluation_row, upsert_task

    ids: dict[str, int] = {}
    with store.session() as session:
        session.add(DeviceProbe(device="cuda", device_name="NVIDIA H100 80GB HBM3", torch_version="2.5.1",
                                bandwidth_gbps=3352.0, flops={"fp32": 66.9}))
        run = Run(kind="optimize", status="finished", model=model, critic=critic, device="cuda",
                  device_name="NVIDIA H100 80GB HBM3", torch_version="2.5.1", code_version="test", config={})
        session.add(run)
        session.flush()
        ids["run"] = run.id
        task = upsert_task(session, LSE_TASK)
        ids["task"] = task.id
        for v in mixed_attempts():
            a = Attempt(run_id=run.id, task_id=task.id, round=v.round, sample=v.sample, parse_status=v.parse_status,
                        source=v.source, parent_ids=[])
            session.add(a)
            session.flush()
            ids[f"a{v.attempt_id}"] = a.id
            if v.result is not None:
                session.add(evaluation_row(v.result, LSE_TASK.key, a.id, run.id))
        session.flush()
    return ids


def test_attempt_views_read_back_the_stored_evidence(store):
    from agent.critic.evidence import attempt_views, device_facts, task_spec
    from store.models import Run, Task

    ids = _fill(store)
    with store.reader() as session:
        views = attempt_views(session, ids["run"], ids["task"])
        assert [v.round for v in views] == [1, 1, 2, 2, 3]
        assert views[0].result is None and views[0].parse_status == "no_code"
        assert views[1].result.status is Status.compile_error and views[1].result.build.first_error_line == 24
        assert views[4].result.candidate_time.median_ms == 2.5001 and views[4].evaluation_id is not None
        dev = device_facts(session, session.get(Run, ids["run"]))
        assert dev.bandwidth_gbps == 3352.0 and dev.tflops == {"fp32": 66.9}
        spec = task_spec(session, session.get(Run, ids["run"]), session.get(Task, ids["task"]), views)
        assert spec.source == LSE_TASK.source and spec.name == LSE_TASK.name


def test_critique_run_stores_a_new_analysis_per_task(store):
    from agent.critic.cli import critique_run
    from store.models import Analysis

    ids = _fill(store, model="builtin", critic="grounded")
    records = critique_run(store, ids["run"])
    assert len(records) == 1 and records[0]["critic"] == "grounded" and records[0]["round"] == 3
    with store.reader() as session:
        rows = session.query(Analysis).all()
        assert len(rows) == 1 and rows[0].round == 3 and rows[0].critic == "grounded"
        assert rows[0].markdown == records[0]["markdown"]
        assert any(f["category"] == "compile_error" for f in rows[0].findings)
    # llm asked for a builtin run: grounded, with a note
    records = critique_run(store, ids["run"], critic="llm")
    assert records[0]["critic"] == "grounded" and "cannot write analyses" in records[0]["note"]
    with pytest.raises(LookupError):
        critique_run(store, ids["run"], task="no/such_task")
    assert critique_run(store, ids["run"], task="gemm_sigmoid_gemm_logsumexp")[0]["task"] == LSE_TASK.name


def test_critique_run_with_an_llm_backend_records_the_model_call(store, monkeypatch):
    from agent.backends import base as backends
    from agent.critic.cli import critique_run
    from store.models import Analysis, ModelCall

    ids = _fill(store)
    monkeypatch.setitem(backends.BACKENDS, "openai", lambda arg, **kw: FakeBackend(text="Attempt 5: 2.50 ms."))
    records = critique_run(store, ids["run"])
    assert records[0]["critic"] == "llm"
    with store.reader() as session:
        call = session.query(ModelCall).one()
        assert call.purpose == "critique" and call.template == "critic_task" and call.prompt_tokens == 1000
        analysis = session.query(Analysis).one()
        assert analysis.model_call_id == call.id and analysis.markdown.startswith("Attempt 5: 2.50 ms.")


def test_critique_command_prints_the_markdown(store, tmp_path):
    import typer
    from typer.testing import CliRunner

    from agent.critic.cli import critique_command

    ids = _fill(store, model="builtin", critic="grounded")
    app = typer.Typer()
    app.command()(critique_command)
    res = CliRunner().invoke(app, [str(ids["run"]), "--db", str(tmp_path / "critic.db")])
    assert res.exit_code == 0, res.output
    assert "## Comparison" in res.output and "stored analysis" in res.output
    res = CliRunner().invoke(app, [str(ids["run"]), "--critic", "bogus", "--db", str(tmp_path / "critic.db")])
    assert res.exit_code == 2
    res = CliRunner().invoke(app, ["999", "--db", str(tmp_path / "critic.db")])
    assert res.exit_code == 2 and "no run 999" in res.output


def test_a_launch_bound_reference_and_a_graph_replay_are_named_from_the_profiles():
    """The reference's kernels fill a third of its eager forward: the critic says it is launch-bound,
    with the candidate's own busy time, and that the candidate replays its forward from a CUDA graph."""
    ref = [KernelStat(name="void at::native::conv_kernel<float>", count=30, total_us=800.0, share=0.8),
           KernelStat(name="void at::native::relu_kernel<float>", count=30, total_us=200.0, share=0.2)]
    prof = [KernelStat(name="void at::native::conv_kernel<float>", count=30, total_us=800.0, share=0.85),
            KernelStat(name="kl_g0_kernel", count=30, total_us=140.0, share=0.15, own=True)]
    r = correct_result(cand=1.25, eager=3.3887, profile=prof, reference=ref, floor=None)
    src = "class ModelNew:\n    def forward(self, x):\n        return _kl_graphed(self, self._kl_forward, (x,))\n"
    a = analyze([view(1, r, src)])
    assert "the reference is launch-bound" in a.markdown and "replayed from a CUDA graph" in a.markdown, a.markdown
    plain = analyze([view(1, correct_result())])
    assert "launch-bound" not in plain.markdown
