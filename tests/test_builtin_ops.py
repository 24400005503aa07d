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
import torch.nn.functional as F

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


MISH_TASK = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return F.mish(x) + 0.0

def get_inputs():
    x = torch.linspace(-110.0, 110.0, 20001)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, 20.0001, 19.9999, 88.0, 89.0,
                            float("inf"), float("-inf"), float("nan")])
    return [torch.cat([x, special, torch.randn(4096) * 3])]

def get_init_inputs():
    return []
'''


def test_mish_is_as_accurate_as_the_composition_over_the_whole_range(tmp_path):
    """``kl_mish`` computes x * p / (p + 2), p = e^x (e^x + 2), instead of x * tanh(log1p(e^x)): its
    error against float64 mish is within that of PyTorch's own float32 composition (a few ulp),
    from -110 to 110, at the softplus threshold (20), and for inf, -inf and NaN as PyTorch gives."""
    path = tmp_path / "mish_range.py"
    path.write_text(MISH_TASK)
    spec = read_spec(path, name="fixtures/mish_range")
    cand = generate(spec, "cpu")
    assert ["mish", "add"] in [g["ops"] for g in cand.choices["groups"]]
    task = load_task(spec)
    (x,) = task.get_inputs()
    ns = _load(cand.source)
    with torch.no_grad():
        got = ns["ModelNew"]()(x)
        torch_f32 = F.mish(x)
    exact = F.mish(x.double())
    finite = exact.isfinite()
    assert torch.equal(got[~finite].isnan(), exact[~finite].isnan())
    assert torch.equal(got[~finite].nan_to_num(), exact[~finite].float().nan_to_num())
    scale = exact[finite].abs().clamp_min(1e-30)
    ours = ((got[finite].double() - exact[finite]).abs() / scale).max().item()
    theirs = ((torch_f32[finite].double() - exact[finite]).abs() / scale).max().item()
    assert ours <= max(2 * theirs, 4 * 2.0 ** -24), (ours, theirs)
