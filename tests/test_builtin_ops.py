"""Every template of the builtin generator, built for real on the CPU and checked against PyTorch.

``fixtures/builtin/all_ops.py`` uses every fused operator once (each output is its own
group) plus fused chains with prologues and epilogues; its candidate is ONE extension, so
the whole catalogue costs one build per knob setting: two builds in this file
(one-pass statistics with ``omp simd``; two-pass statistics without).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate
from sandbox.tasks import load_task, read_spec

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
ATOL = RTOL = 1e-4

EXPECTED_OPS = {
    "add", "sub", "mul", "div", "add_alpha", "relu", "leaky_relu", "gelu", "gelu_tanh", "sigmoid", "tanh",
    "silu", "mish", "hardswish", "hardsigmoid", "hardtanh", "clamp", "clamp_min", "clamp_max", "softplus",
    "elu", "selu", "exp", "log", "abs", "neg", "maximum", "minimum", "square", "sqrt", "pow", "rsqrt",
    "log1p", "expm1", "logsigmoid", "softsign",
    "sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax",
    "group_norm", "layer_norm", "instance_norm", "batch_norm",
}


def _spec():
    return read_spec(FIXTURES / "all_ops.py", name="fixtures/all_ops")


def _load(source: str) -> dict:
    ns: dict = {"__name__": "kl_candidate_under_test"}
    exec(compile(source, "candidate.py", "exec"), ns)
    return ns


def _compare(ref_out, new_out, what: str) -> list[str]:
    bad = []
    assert len(ref_out) == len(new_out)
    for i, (a, b) in enumerate(zip(ref_out, new_out)):
        if a.shape != b.shape:
            bad.append(f"{what} output {i}: shape {tuple(b.shape)} != {tuple(a.shape)}")
        elif not torch.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True):
            err = (a - b).abs().nan_to_num(float("inf")).max().item()
            bad.append(f"{what} output {i}: max abs err {err:.3g}")
    return bad


@pytest.fixture(scope="module")
def task():
    return load_task(_spec())


def test_catalogue_is_fully_covered():
    cand = generate(_spec(), "cpu")
    assert cand.uncovered_ops == []
    assert EXPECTED_OPS <= set(cand.covered_ops)
    assert "Model(" not in cand.source
    compile(cand.source, "candidate.py", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [Knobs("max", True, 256, "onepass"), Knobs("max", False, 128, "twopass")],
                         ids=["onepass-simd", "twopass-novec"])
def test_every_template_matches_pytorch_on_cpu(task, knobs):
    cand = generate(_spec(), "cpu", knobs)
    assert cand.choices["knobs"]["reduce"] == knobs.reduce
    ns = _load(cand.source)
    init = task.get_init_inputs()
    torch.manual_seed(123)
    ref = task.Model(*init)
    torch.manual_seed(123)
    new = ns["ModelNew"](*init)
    for (n1, p1), (n2, p2) in zip(ref.state_dict().items(), new.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"parameter {n1} differs: the constructors diverged"
    problems = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        inputs = task.get_inputs()
        with torch.no_grad():
            r = ref(*[t.clone() for t in inputs])
            n = new(*[t.clone() for t in inputs])
        problems += _compare(r, n, f"seed {seed}")
    # training-mode BatchNorm updates its running statistics like the reference
    for name in ("bn", "bn1d"):
        a, b = getattr(ref, name), getattr(new, name)
        assert torch.allclose(a.running_mean, b.running_mean, atol=1e-5, rtol=1e-4), name
        assert torch.allclose(a.running_var, b.running_var, atol=1e-5, rtol=1e-4), name
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 2
    # eval mode: BatchNorm normalises with the running statistics
    ref_e, new_e = copy.deepcopy(ref).eval(), copy.deepcopy(new).eval()
    torch.manual_seed(3)
    inputs = task.get_inputs()
    with torch.no_grad():
        problems += _compare(ref_e(*inputs), new_e(*inputs), "eval")
    # a contiguous-but-odd input: a non-contiguous view is made contiguous by the wrapper
    torch.manual_seed(4)
    inputs = task.get_inputs()
    inputs[0] = inputs[0].transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        problems += _compare(ref(*inputs), new(*inputs), "strided")
    assert not problems, "\n".join(problems)
