"""Prompt rendering: what each prompt carries, which attempts it shows, and its hash."""
from __future__ import annotations

import hashlib
import json

import jinja2
import pytest

from agent.parse import parse_answer
from agent.prompts import (FIRST, REFINE, build_proposal_messages, cap_source, choose_attempts, evidence, render,
                           render_text)
from agent.types import AttemptView, DeviceFacts
from sandbox.numerics import Numerics
from sandbox.result import (BuildInfo, EvalResult, Flag, FlagKind, KernelStat, OutputCheck, Status, Timing,
                            Tolerance, Trial)
from sandbox.tasks import TaskSpec

REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.relu(self.linear(x))


batch_size = 128
in_features = 1024
out_features = 512


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
'''

TASK = TaskSpec(name="seeds/linear_relu", path="/tasks/seeds/linear_relu.py", source=REF)
GPU = DeviceFacts(device="cuda", name="NVIDIA H100 80GB HBM3", torch_version="2.5.1", compute_capability="9.0",
                  sm_count=132, bandwidth_gbps=3012.4, tflops={"fp32": 51.2, "fp16": 740.0})
CPU = DeviceFacts(device="cpu", name="AMD EPYC 7B13", torch_version="2.13.0", bandwidth_gbps=18.5,
                  tflops={"fp32": 0.41})
TOL = Tolerance(atol=1e-4, rtol=1e-4)


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, iqr_ms=ms * 0.02, mean_ms=ms, min_ms=ms, max_ms=ms, runs=20, clock="cuda_event")


def correct(ms: float, **extra) -> EvalResult:
    fields = dict(status=Status.correct, task=TASK.name, device="cuda", candidate_time=timing(ms),
                  eager_time=timing(0.08), compile_time=timing(0.06), speedup_eager=0.08 / ms,
                  speedup_compile=0.06 / ms, floor_ms=0.01, floor_fraction=0.01 / ms, custom_calls_per_forward=2.0,
                  profile=[KernelStat(name="fused_linear_relu_kernel", count=1, total_us=40, share=0.8, own=True),
                           KernelStat(name="aten::copy_", count=1, total_us=10, share=0.2)])
    fields.update(extra)
    return EvalResult(**fields)


def compile_error(message: str = 'error: identifier "i" is undefined', line: int = 31) -> EvalResult:
    return EvalResult(status=Status.compile_error, task=TASK.name, device="cuda",
                      build=BuildInfo(ok=False, first_error=message, first_error_line=line, log="... " + message))


def incorrect() -> EvalResult:
    bad = OutputCheck(index=0, shape=[128, 512], dtype="float32", ref_shape=[128, 512], ref_dtype="float32",
                      max_abs_err=0.31, max_rel_err=2.5, mismatched=512, numel=65536,
                      mismatch_pattern="tile_edges", bad_rows=[0, 31, 32], tolerance=TOL)
    return EvalResult(status=Status.incorrect, task=TASK.name, device="cuda", trials=[
        Trial(index=0, candidate_first=True, passed=True),
        Trial(index=1, candidate_first=False, passed=False, reason="output 0 outside tolerance", outputs=[bad])])


def runtime_error() -> EvalResult:
    return EvalResult(status=Status.runtime_error, task=TASK.name, device="cuda", error_type="RuntimeError",
                      error_message="CUDA error: an illegal memory access was encountered",
                      traceback="Traceback (most recent call last):\n  File \"cand.py\", line 40\nRuntimeError: CUDA error")


def src(tag: str) -> str:
    return f"import torch\n# {tag}\nclass ModelNew(torch.nn.Module):\n    pass\n"


def view(i: int, rnd: int, result=None, source=None, parse_status="ok", parse_error=None) -> AttemptView:
    return AttemptView(attempt_id=i, round=rnd, sample=i % 4, parse_status=parse_status,
                       source=source if source is not None else (src(f"attempt {i}") if result else None),
                       result=result, parse_error=parse_error)


def history() -> list[AttemptView]:
    flagged = correct(0.01, flags=[Flag(kind=FlagKind.fallback, reason="forward calls torch.nn.functional.linear")])
    return [
        view(1, 0, parse_status="truncated", parse_error="the answer was cut off at max_tokens inside a code block"),
        view(2, 0, compile_error()),
        view(3, 1, incorrect()),
        view(4, 1, correct(0.05)),
        view(5, 2, runtime_error()),
        view(6, 2, correct(0.09)),
        view(7, 2, flagged),
        view(8, 2, compile_error()),                       # same compiler error as attempt 2
    ]


# ------------------------------------------------------------------ render

def test_render_gives_system_and_user_messages_and_their_hash():
    messages, sha = render(FIRST, task=TASK, device=GPU, round=0, floor_ms=None, numerics=Numerics())
    assert [m["role"] for m in messages] == ["system", "user"]
    assert sha == hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    again, sha2 = render(FIRST + ".j2", task=TASK, device=GPU, round=0, floor_ms=None, numerics=Numerics())
    assert again == messages and sha2 == sha
    other, sha3 = render(FIRST, task=TASK, device=CPU, round=0, floor_ms=None, numerics=Numerics())
    assert sha3 != sha


@pytest.mark.parametrize("numerics, says", [
    (Numerics(), ["fp32/default", "cuDNN convolutions in TF32", "atol = rtol = 0.0001", "float64"]),
    (Numerics(math="strict"), ["fp32/strict", "IEEE float32 throughout"]),
    (Numerics(precision="bf16"), ["bf16/default", "cast to bfloat16", "accumulate in float32", "atol = rtol = 0.01"]),
])
def test_the_prompt_states_the_runs_numerics(numerics, says):
    _, messages, sha = build_proposal_messages(TASK, GPU, 0, [], None, None, numerics=numerics)
    text = messages[-1]["content"]
    for phrase in says:
        assert phrase in text
    assert sha != build_proposal_messages(TASK, GPU, 0, [], None, None,
                                          numerics=Numerics(precision="fp16", math="strict"))[2]


def test_render_without_system_message():
    messages, _ = render(FIRST, system_template=None, task=TASK, device=GPU, round=0, floor_ms=None, numerics=Numerics())
    assert [m["role"] for m in messages] == ["user"]


def test_missing_variable_is_an_error_not_an_empty_string():
    with pytest.raises(jinja2.UndefinedError):
        render_text(FIRST, task=TASK, round=0, floor_ms=None, numerics=Numerics())


# ------------------------------------------------------------------ first round

def test_first_round_prompt_for_cuda():
    name, messages, sha = build_proposal_messages(TASK, GPU, 0, [], None, 0.0123)
    assert name == FIRST
    system, user = (m["content"] for m in messages)
    assert "CUDA" in system
    assert REF.strip() in user
    for fact in ("NVIDIA H100 80GB HBM3", "compute capability 9.0", "132 SMs", "3012 GB/s",
                 "fp32 51.2 TFLOP/s", "fp16 740 TFLOP/s", "0.0123 ms"):
        assert fact in user, fact
    assert "class ModelNew(nn.Module)" in user and "load_inline" in user
    assert "no call to the reference `Model`" in user
    assert "__global__" in user and "cuda_sources" in user
    assert "-fopenmp" not in user
    assert sha == build_proposal_messages(TASK, GPU, 0, [], None, 0.0123)[2]


def test_first_round_prompt_for_cpu_with_size_overrides():
    task = TaskSpec(name=TASK.name, path=TASK.path, source=REF, overrides={"batch_size": 16, "in_features": 64})
    _, messages, _ = build_proposal_messages(task, CPU, 0, [], None, None)
    system, user = (m["content"] for m in messages)
    assert "CPU" in system
    assert "Device: CPU, AMD EPYC 7B13" in user and "18 GB/s" in user
    assert "-fopenmp" in user and "__global__" not in user and "cuda_sources=" not in user
    assert "`batch_size = 16`" in user and "`in_features = 64`" in user
    assert "Roofline floor" not in user                    # none given


def test_history_empty_means_first_prompt_at_any_round():
    assert build_proposal_messages(TASK, GPU, 3, [], "analysis", None)[0] == FIRST


@pytest.mark.parametrize("device", [GPU, CPU])
def test_worked_example_obeys_the_contract(device):
    _, messages, _ = build_proposal_messages(TASK, device, 0, [], None, None)
    parsed = parse_answer(messages[1]["content"], "stop")     # the example is the prompt's last python block
    assert parsed.status == "ok"
    assert "load_inline" in parsed.source
    assert "torch.relu" not in parsed.source                  # the example does not fall back to PyTorch


# ------------------------------------------------------------------ choosing attempts

def test_choice_best_first_then_one_failure_per_kind_newest_first():
    chosen = choose_attempts(history(), max_shown=6)
    assert [(role, a.attempt_id) for role, a in chosen] == [
        ("best", 4),         # fastest clean correct; attempt 7 is faster but flagged
        ("failure", 7),      # round 2 flagged (got furthest)
        ("failure", 5),      # round 2 runtime error
        ("failure", 8),      # round 2 compile error (attempt 2 has the same error, so it is not shown)
        ("failure", 3),      # round 1 incorrect
        ("failure", 1),      # round 0 truncated answer
    ]


def test_choice_respects_the_cap_and_fills_with_other_correct_attempts():
    assert len(choose_attempts(history(), max_shown=3)) == 3
    assert choose_attempts(history(), max_shown=0) == []
    h = [view(1, 0, correct(0.2)), view(2, 0, correct(0.1)), view(3, 1, correct(0.3))]
    assert [(r, a.attempt_id) for r, a in choose_attempts(h, 4)] == [("best", 2), ("correct", 1), ("correct", 3)]


def test_a_correct_attempt_only_contended_is_the_one_to_beat_when_none_is_clean():
    """Its timing was disturbed (the machine's doing, not the candidate's): the model is still asked to
    beat it, with its flag shown, never told that no attempt is correct."""
    contended = correct(0.05, flags=[Flag(kind=FlagKind.contended, reason="a burst of load took one side's block")])
    fallback = correct(0.01, flags=[Flag(kind=FlagKind.fallback, reason="forward calls torch.nn.functional.linear")])
    h = [view(1, 0, compile_error()), view(2, 0, contended), view(3, 0, fallback)]
    assert [(r, a.attempt_id) for r, a in choose_attempts(h, 4)] == [("best", 2), ("failure", 3), ("failure", 1)]
    user = build_proposal_messages(TASK, GPU, 1, h, None, None)[1][1]["content"]
    assert "Best so far: attempt 2" in user and "Write a faster `ModelNew` than attempt 2" in user
    assert "flag contended: a burst of load" in user and "No attempt is correct yet" not in user
    # a clean attempt, however slow, comes first: the contended one is then a flagged attempt
    h.append(view(4, 1, correct(0.2)))
    assert [(r, a.attempt_id) for r, a in choose_attempts(h, 2)] == [("best", 4), ("failure", 3)]


def test_choice_never_shows_the_same_source_twice():
    same = src("same")
    h = [view(1, 0, compile_error("error: a"), source=same), view(2, 1, compile_error("error: b"), source=same),
         view(3, 1, compile_error("error: c"))]
    ids = [a.attempt_id for _, a in choose_attempts(h, 4)]
    assert ids == [3, 2]                                  # attempt 1 repeats attempt 2's source


def test_second_pass_adds_other_causes_of_the_same_kind():
    h = [view(1, 0, compile_error("error: a")), view(2, 0, compile_error("error: b")),
         view(3, 0, compile_error("error: a"))]
    ids = [a.attempt_id for _, a in choose_attempts(h, 4)]
    assert ids == [3, 2]


# ------------------------------------------------------------------ evidence

def test_evidence_lines():
    h = {a.attempt_id: a for a in history()}
    assert any('first compiler error (line 31 of the candidate\'s source): error: identifier "i" is undefined' in line
               for line in evidence(h[2]))
    inc = " ".join(evidence(h[3]))
    assert "1 of 2 trials passed" in inc
    assert "512 of 65536 elements outside tolerance" in inc
    assert "max abs error 0.31" in inc and "max rel error 2.5" in inc
    assert "tile_edges" in inc and "31, 32" in inc
    best = " ".join(evidence(h[4]))
    assert "runtime 0.05 ms" in best and "eager 0.08 ms (80 us), speedup 1.60x" in best
    assert "torch.compile 0.06 ms (60 us), speedup 1.20x" in best
    assert "roofline floor 0.01 ms" in best and "20% of the roofline" in best
    assert "fused_linear_relu_kernel 80% (yours)" in best
    run = " ".join(evidence(h[5]))
    assert "RuntimeError: CUDA error: an illegal memory access" in run
    assert "flag fallback: forward calls torch.nn.functional.linear" in " ".join(evidence(h[7]))
    trunc = " ".join(evidence(h[1]))
    assert "cut off at max_tokens" in trunc and "shorter" in trunc


def test_refine_prompt_carries_attempts_figures_and_analysis():
    analysis = "## Findings\n- attempt 3: the tile edges are not guarded (max abs err 0.31)."
    name, messages, sha = build_proposal_messages(TASK, GPU, 3, history(), analysis, 0.0123, max_attempts_shown=4)
    assert name == REFINE
    user = messages[1]["content"]
    assert REF.strip() in user
    assert "This is round 3" in user
    assert "8 attempts over 3 rounds" in user
    assert "eager 0.08 ms" in user and "torch.compile 0.06 ms" in user and "roofline floor 0.0123 ms" in user
    assert "Best so far: attempt 4" in user and "Flagged: attempt 7" in user
    assert "# attempt 4" in user and "# attempt 5" in user and "# attempt 8" in user
    assert "# attempt 3" not in user and "# attempt 2" not in user       # beyond the cap / a repeat
    assert "(4 of 8)" in user
    assert analysis.split("\n")[1] in user
    assert "Write a faster `ModelNew` than attempt 4" in user
    assert "class ModelNew(nn.Module)" in user                           # the contract again
    assert "__global__ void add_relu_kernel" not in user                 # no worked example in refinement
    assert sha != build_proposal_messages(TASK, GPU, 3, history(), None, 0.0123, max_attempts_shown=4)[2]


def test_refine_without_a_correct_attempt_asks_for_a_fix():
    h = [view(1, 0, compile_error()), view(2, 0, incorrect())]
    _, messages, _ = build_proposal_messages(TASK, CPU, 1, h, None, None)
    user = messages[1]["content"]
    assert "No attempt is correct yet" in user
    assert "## Analysis" not in user
    assert "roofline floor unknown" in user and "eager not measured" in user


def test_long_sources_are_capped_around_the_compiler_error():
    body = "\n".join(f"x{i} = {i}  # filler line number {i:04d}" for i in range(1, 1001))
    source = "import torch\n" + body + "\nclass ModelNew(torch.nn.Module):\n    pass\n"
    error_line = 500
    h = [view(1, 0, compile_error("error: bad thing", line=error_line), source=source)]
    _, messages, _ = build_proposal_messages(TASK, GPU, 1, h, None, None, max_source_chars=4000)
    user = messages[1]["content"]
    assert "lines omitted" in user
    assert f"filler line number {error_line - 1:04d}" in user             # the failing line (1-based, after import)
    assert "class ModelNew(torch.nn.Module)" in user                      # the tail
    assert "import torch\nx1 = 1" in user                                 # the head
    assert len(user) < len(source)


def test_cap_source_keeps_short_sources_and_bounds_long_ones():
    short = "a = 1\n"
    assert cap_source(short, 100) == short
    long = "".join(f"line_{i} = {i}\n" for i in range(500))
    capped = cap_source(long, 1000)
    assert len(capped) < 1200
    assert capped.startswith("line_0 = 0\n") and capped.rstrip().endswith("line_499 = 499")
    assert "lines omitted" in capped


def _run_example(device: DeviceFacts, torch_device: str) -> None:
    import torch

    _, messages, _ = build_proposal_messages(TASK, device, 0, [], None, None)
    parsed = parse_answer(messages[1]["content"], "stop")
    namespace: dict = {"__name__": f"kernelloop_example_{torch_device}"}
    exec(compile(parsed.source, "<example>", "exec"), namespace)
    model = namespace["ModelNew"]().to(torch_device)
    a = torch.randn(1000, 333, device=torch_device)
    b = torch.randn(1000, 333, device=torch_device)
    torch.testing.assert_close(model(a, b), torch.relu(a + b), rtol=0, atol=0)
    a = torch.randn(9, device=torch_device)[::2]                          # non-contiguous input
    b = torch.randn(5, device=torch_device)
    torch.testing.assert_close(model(a, b), torch.relu(a + b), rtol=0, atol=0)


@pytest.mark.slow
def test_cpu_worked_example_builds_and_is_correct():
    _run_example(CPU, "cpu")


@pytest.mark.gpu
def test_cuda_worked_example_builds_and_is_correct():
    _run_example(GPU, "cuda")


def test_the_proposer_sees_the_named_error_pattern_with_its_indices():
    """The feedback names where an incorrect output is wrong as the critic does (rows 96-127, the
    last 32 of 128), not only a label and the first bad rows."""
    import torch

    from sandbox.compare import compare_outputs
    from sandbox.result import EvalConfig

    torch.manual_seed(0)
    ref = torch.randn(128, 64) + 3.0
    out = ref.clone()
    out[96:] = 0
    ok, _, checks = compare_outputs([ref], [out], EvalConfig())
    assert not ok
    result = EvalResult(status=Status.incorrect, task=TASK.name, device="cpu", trials=[
        Trial(index=0, candidate_first=True, passed=False, reason="output 0 outside tolerance", outputs=checks)])
    text = "\n".join(evidence(view(1, 0, result)))
    assert "rows 96-127, the last 32 of 128 (one block of 32), are wrong" in text
