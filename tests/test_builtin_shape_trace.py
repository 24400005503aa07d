"""A forward whose Python control flow reads its input's shape (KernelBench level3/34's
``seq_len, batch_size, _ = x.size()`` and ``for t in range(seq_len)``): traced specialised on the
example inputs' shapes (``agent.builtin.trace._ShapeTracer``), the loop unrolled, each step's
identical group calling one kernel (``codegen.share_kernels``), and any other input shape refused
by the candidate. Everything runs without a compiler except the sandbox test (one C++ build).
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from agent.builtin import generate, propose, replay_verdict
from agent.builtin.trace import trace_task
from sandbox.tasks import TaskSpec, read_spec, with_device_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
LOOP = FIXTURES / "rnn_loop.py"
REFUSED = "ModelNew was generated for x of shape (6, 2, 8)"

QUESTIONS = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x, y):
        n = x.size(0)
        assert x.dim() == 3 and x.ndim == 3 and len(x) == n and x.numel() == n * x.shape[1] * x.size(-1)
        out = x[0] * 0.0
        for i in range(x.shape[0]):
            out = torch.relu(out + x[i])
        return out * y

def get_inputs():
    return [torch.randn(3, 4, 5), torch.randn(4, 5)]

def get_init_inputs():
    return []
'''

REPEATED = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.b(torch.relu(self.a(x))))

def get_inputs():
    return [torch.randn(4, 8)]

def get_init_inputs():
    return []
'''


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _spec(path: Path) -> TaskSpec:
    return with_device_sizes(read_spec(path, name=f"fixtures/{path.stem}"), "cpu")


def _inline(source: str, name: str, tmp_path: Path) -> TaskSpec:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return read_spec(path, name=f"inline/{name}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_loop_over_the_inputs_size_unrolls_into_one_shared_kernel(device):
    """Six steps, six tanh groups: the first has the kernel, the other five call it (the header's
    ``kernel``); the extension binds one function, and the forward checks the shape first."""
    traced = trace_task(_spec(LOOP), device)
    assert traced.ok and traced.shapes == {"x": (6, 2, 8)}
    cand = generate(_spec(LOOP), device)
    groups = cand.choices["groups"]
    assert "fallback" not in cand.choices and [g["ops"] for g in groups] == [["tanh"]] * 6
    assert [g.get("kernel") for g in groups] == [None] + ["kl_g0"] * 5
    assert cand.source.count("---- kl_g0 begin") == 1 and "---- kl_g1 begin" not in cand.source
    assert "functions=['kl_g0']" in cand.source
    assert cand.source.count("_ext.kl_g0(") == 6
    # (on cuda the generated forward is ``_kl_forward``, replayed from a CUDA graph: graphed.py)
    forward = re.split(r"def (?:_kl_)?forward\(self, x, h0\):", cand.source)[1].splitlines()
    assert forward[1].strip() == "if tuple(x.shape) != (6, 2, 8):" and REFUSED in forward[2]


def test_every_shape_question_of_an_input_is_answered(tmp_path):
    """size(), size(d), shape, shape[d], dim(), ndim, len() and numel() of an input are the example's
    sizes (an assert on them and a loop over shape[0] trace); an input whose shape nothing asked
    gets no check."""
    spec = _inline(QUESTIONS, "questions", tmp_path)
    traced = trace_task(spec, "cpu")
    assert traced.ok, traced.error
    assert traced.shapes == {"x": (3, 4, 5)}
    cand = generate(spec, "cpu")
    assert "if tuple(x.shape) != (3, 4, 5):" in cand.source and "tuple(y.shape)" not in cand.source


def test_a_traceable_forward_is_traced_as_before_and_its_repeated_groups_share_a_kernel(tmp_path):
    """Only a forward the symbolic trace cannot follow is specialised: a traceable one has no shape
    check. Two groups that compute the same call one kernel there too (a ResNet's repeated
    blocks: level3/10's candidate 2.68 MB as a kernel per group, 189 KB shared)."""
    spec = _inline(REPEATED, "repeated", tmp_path)
    assert trace_task(spec, "cpu").shapes == {}
    cand = generate(spec, "cpu")
    assert [g["ops"] for g in cand.choices["groups"]] == [["relu"], ["relu"]]
    assert [g.get("kernel") for g in cand.choices["groups"]] == [None, "kl_g0"]
    assert "functions=['kl_g0']" in cand.source and "raise ValueError" not in cand.source


def test_an_input_of_another_shape_is_refused(monkeypatch):
    """The candidate, run (its extension stubbed) with a longer sequence: the clear error, before
    any kernel is called; with the traced shape it runs to the end."""
    import torch
    import torch.utils.cpp_extension as ext

    calls = []

    def fake(name, cpp_sources, functions=None, **kw):
        return types.SimpleNamespace(**{f: (lambda t: calls.append(f) or torch.tanh(t)) for f in functions})

    monkeypatch.setattr(ext, "load_inline", fake)
    cand = generate(_spec(LOOP), "cpu")
    ns: dict = {}
    exec(compile(cand.source, "candidate.py", "exec"), ns)
    model = ns["ModelNew"](8, 5, 3)
    with pytest.raises(ValueError, match=r"generated for x of shape \(6, 2, 8\).*got \(7, 2, 8\)"):
        model(torch.rand(7, 2, 8), torch.rand(2, 5))
    assert calls == []
    assert model(torch.rand(6, 2, 8), torch.rand(2, 5)).shape == (6, 2, 3) and calls == ["kl_g0"] * 6


def test_a_failure_of_the_shared_kernel_blames_every_group_calling_it():
    """A runtime error naming kl_g0: all six steps' groups are its, so all six are narrowed (left to
    PyTorch), not only the first."""
    from agent.types import AttemptView
    from sandbox.result import EvalResult, Status

    cand = propose(_spec(LOOP), "cpu", 0, 0, [])
    failed = EvalResult(status=Status.runtime_error, task="t", device="cpu",
                        error_message="RuntimeError: kl_g0 (tanh): something went wrong")
    history = [AttemptView(attempt_id=1, round=0, sample=0, parse_status="ok", source=cand.source, result=failed)]
    after = propose(_spec(LOOP), "cpu", 1, 0, history)
    tanhs = {"tanh"} | {f"tanh_{i}" for i in range(1, 6)}
    assert tanhs <= set(after.choices["excluded"])
    assert not any("tanh" in g["ops"] for g in after.choices["groups"])


def test_the_replay_runs_the_unrolled_candidate():
    verdict = replay_verdict(_spec(LOOP))
    assert verdict.ran and not verdict.semantic and not verdict.unverifiable, verdict.notes


def test_the_replay_blames_every_group_calling_a_wrong_shared_kernel(monkeypatch):
    """The plan reads tanh as sigmoid (a planted bug): the replay finds the one kernel wrong and
    leaves all six steps' tanh to PyTorch."""
    from agent.builtin import plan as plan_mod

    real = plan_mod.classify

    def planted(node, modules, constants):
        info = real(node, modules, constants)
        if info.op == "tanh":
            info.op = "sigmoid"
        return info

    monkeypatch.setattr(plan_mod, "classify", planted)
    verdict = replay_verdict(_spec(LOOP))
    assert verdict.semantic == ["kl_g0"], verdict.notes
    assert verdict.excluded == {"tanh"} | {f"tanh_{i}" for i in range(1, 6)}


def test_the_unrolled_candidate_is_correct_in_the_cpu_sandbox():
    """One C++ build: the proposal judged by the sandbox against the reference (fp32 tolerance,
    float64 rule); the same source with the shared kernel planted wrong is judged incorrect."""
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status

    spec = _spec(LOOP)
    cand = propose(spec, "cpu", 0, 0, [])
    cfg = EvalConfig(numerics=Numerics(), trials=2, warmup_runs=1, timed_runs=2, time_compile=False, profile=False)
    result = evaluate(spec, cand.source, "cpu", cfg)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and all(c.mismatched == 0 for c in checks)
    right = "const float t_tanh = tanhf(a0);"
    assert cand.source.count(right) == 1
    wrong = evaluate(spec, cand.source.replace(right, "const float t_tanh = tanhf(a0) * 0.99f;"), "cpu", cfg)
    assert wrong.status is Status.incorrect, (wrong.status, wrong.error_message)


# --------------------------------------------------------------------------------------
# a forward that assigns module attributes (state kept across calls)
# --------------------------------------------------------------------------------------
STATE = FIXTURES / "rnn_state.py"


def test_a_forward_assigning_module_attributes_traces_and_the_candidate_assigns_them_too():
    """level3/33_VanillaRNN assigns ``self.hidden`` (a plain tensor attribute) in forward. The
    tracer left proxies on the model, the graph module copied them, and every way of tracing
    failed ("_tensor_constant0 references nonexistent attribute"): the task had no candidate
    of its own. Now the model's attributes come back after the trace, the last value assigned
    is a group's output, and the candidate's forward assigns it as the reference's does."""
    spec = read_spec(STATE, name="fixtures/rnn_state")
    traced = trace_task(spec, "cpu")
    assert traced.ok, traced.error
    assert list(traced.rebinds) == ["hidden"] and traced.rebinds["hidden"].name == "tanh"
    cand = generate(spec, "cpu")
    kinds = [g["ops"] for g in cand.choices["groups"]]
    assert kinds == [["mul", "add", "tanh"]], kinds              # the assigned value ends its group
    forward = cand.source[cand.source.index("    def forward"):]
    assert "        self.hidden = v_tanh\n        return v_h2o" in forward


def test_the_candidate_keeps_the_references_state_across_calls():
    """Run in one process: after each of two forwards (different inputs) the candidate's output and
    its ``hidden`` attribute equal the reference's."""
    import torch

    from sandbox.tasks import load_task

    spec = read_spec(STATE, name="fixtures/rnn_state")
    cand = generate(spec, "cpu")
    ns: dict = {"__name__": "kl_candidate"}
    exec(compile(cand.source, "rnn_state_candidate.py", "exec"), ns)
    task = load_task(spec)
    torch.manual_seed(0)
    ref = task.Model(*task.get_init_inputs())
    torch.manual_seed(0)
    new = ns["ModelNew"](*task.get_init_inputs())
    for seed in (1, 2):
        torch.manual_seed(seed)
        inputs = task.get_inputs()
        with torch.no_grad():
            want, got = ref(*inputs), new(*[t.clone() for t in inputs])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new.hidden, ref.hidden, rtol=1e-5, atol=1e-6)
        assert new.hidden is not inputs[1]


def test_the_stateful_candidate_is_correct_in_the_cpu_sandbox():
    from builtin_candidate import judge
    from sandbox.result import Status

    spec = read_spec(STATE, name="fixtures/rnn_state")
    result = judge(spec, propose(spec, "cpu", 0, 0).source, "cpu")
    assert result.status is Status.correct, (result.status, result.error_message, result.flags)
    assert not any(f.kind == "no_custom_kernel" for f in result.flags), result.flags


DEVICE_CHECK = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        n = x.size()[1]
        if x.device != self.w.device:
            raise ValueError(f"x.device {x.device} != w.device {self.w.device}")
        y = torch.matmul(x.view(-1, 5), self.w).view(-1, n, 6)
        if x.device == self.w.device:
            y = torch.relu(y) * 2.0
        return y

def get_inputs():
    return [torch.randn(3, 4, 5)]

def get_init_inputs():
    return []
'''


def test_control_flow_over_a_comparison_of_devices_is_answered_as_the_harness_runs(tmp_path):
    """level3/46-47 (NetVLAD) raise unless the input is on the clusters' device: the tracer could not
    follow that branch and the tasks had no candidate. Model and inputs run on one device in the
    harness, so == is True and != False; the comparisons leave the graph, the rest is traced."""
    import operator

    import torch

    spec = _inline(DEVICE_CHECK, "device_check", tmp_path)
    traced = trace_task(spec, "cpu")
    assert traced.ok, traced.error
    nodes = list(traced.gm.graph.nodes)
    assert not any(n.op == "call_function" and n.target in (operator.eq, operator.ne) for n in nodes)
    assert not any(n.op == "call_function" and n.target is getattr and n.args[1] == "device" for n in nodes)
    assert any(n.op == "call_function" and n.target is torch.relu for n in nodes)       # the == branch taken
    cand = generate(spec, "cpu")
    assert [g["ops"] for g in cand.choices["groups"]] == [["relu", "mul"]]
    ns: dict = {"__name__": "kl_candidate"}
    exec(compile(cand.source, "device_check_candidate.py", "exec"), ns)
    from sandbox.tasks import load_task

    task = load_task(spec)
    torch.manual_seed(0)
    ref = task.Model()
    torch.manual_seed(0)
    new = ns["ModelNew"]()
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(new(x), ref(x))


META_CONSTANTS = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = int(torch.tensor(4).item())          # no meta model: the CPU way's meta tracer traces a copy
        self.scale = nn.Parameter(torch.linspace(0.5, 6.0, self.n))
        self.register_buffer("mask", torch.tril(torch.ones(self.n, self.n)))

    def forward(self, x):
        y = torch.relu(x @ x.transpose(-1, -2))
        if y.shape[-1] != self.n:                     # a computed tensor's shape: only the meta tracer answers
            raise ValueError("unexpected shape")
        s = torch.clamp(self.scale, max=torch.log(torch.tensor(1.0 / 0.01)))    # a tensor built in the forward
        bias = self.mask.masked_fill(self.mask == 0, -1.0)                       # computed from a buffer
        return torch.tanh(y * s + bias)

def get_inputs():
    return [torch.randn(3, 4, 5)]

def get_init_inputs():
    return []
'''


def test_the_meta_tracers_constants_and_buffer_values_reach_the_real_model(tmp_path):
    """level3/30_SwinTransformerV2 was untraceable: the meta tracer traced a meta copy of the model,
    the tensor its forward built (``torch.tensor(1. / 0.01)``) stayed on that copy as the tracer's
    ``_tensor_constant0`` ("'Model' object has no attribute '_tensor_constant0'"), and a value
    computed from a buffer was frozen into the graph as a meta tensor. Now the constant is the real
    model's too and the buffer is a node of the graph: the candidate replays correctly."""
    spec = _inline(META_CONSTANTS, "meta_constants", tmp_path)
    traced = trace_task(spec, "cpu")
    assert traced.ok and traced.how == "cpu", traced.error
    assert traced.shapes == {"x": (3, 4, 5)}
    targets = {str(n.target) for n in traced.gm.graph.nodes if n.op == "get_attr"}
    assert "mask" in targets and any(t.startswith("_tensor_constant") for t in targets), targets
    assert all(not v.is_meta for v in traced.constants.values()) and traced.constants
    verdict = replay_verdict(spec)
    assert verdict.ran and not verdict.semantic and not verdict.unverifiable, verdict.notes
