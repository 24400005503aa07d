"""Coverage of the builtin proposer: every traced task gets a candidate whose Python side is whole.

* the fx constant case (``torch.min(x, torch.tensor(c))`` traces to ``_tensor_constant0``, an
  attribute only the traced model has) is built and run on the CPU against the reference;
* a generator bug costs the task its kernels, not every attempt: the candidate falls back to the
  reference's forward with the reason in its header;
* the sweep (marker ``kernelbench``, skipped where ../shared/KernelBench is absent) proposes for
  every KernelBench level-1 and level-2 task (trace and render only, meta tensors, no build) and
  lists each task whose candidate raises, falls back, or reads a name or an attribute of ``self``
  that the candidate's module or model does not define.
"""
from __future__ import annotations

import ast
import builtins
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from builtin_candidate import reference_and_candidate

from agent.builtin import propose
from sandbox.tasks import TaskSpec, load_task, read_spec, with_device_sizes

FX_CONSTANT = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, channels, constant_value, scaling_factor):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)
        self.constant_value = constant_value
        self.bias = nn.Parameter(torch.randn(channels, 1, 1))
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.conv(x)
        x = torch.min(x, torch.tensor(self.constant_value))
        x = x + self.bias
        return x * self.scaling_factor

def get_inputs():
    return [torch.randn(2, 3, 9, 7)]

def get_init_inputs():
    return [5, 0.25, 2.0]
'''


def _fx_constant_spec(tmp_path: Path) -> TaskSpec:
    path = tmp_path / "conv_min_constant.py"
    path.write_text(FX_CONSTANT)
    return read_spec(path, name="fixtures/conv_min_constant")


def _stub_load_inline(monkeypatch) -> None:
    import torch.utils.cpp_extension as ext

    def fake(name, cpp_sources, cuda_sources=None, functions=None, **kw):
        return types.SimpleNamespace(**{f: (lambda *a, **k: None) for f in functions or []})

    monkeypatch.setattr(ext, "load_inline", fake)


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """``a.b.c`` for every ``self.a.b.c`` the class reads."""
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "self":
                out.add(".".join(reversed(parts)))
    return out


def _free_names(cls: ast.ClassDef) -> set[str]:
    """Names the class's methods read that they do not bind themselves."""
    loads = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {a.arg for a in ast.walk(cls) if isinstance(a, ast.arg)}
    return loads - bound


def candidate_problems(spec: TaskSpec, device: str) -> list[str]:
    """What is wrong with the builtin's first candidate for ``spec``, checked without a build
    (``load_inline`` must be stubbed by the caller): empty when nothing is."""
    try:
        cand = propose(spec, device, 0, 0, [])
    except Exception as exc:  # noqa: BLE001 - listed, not raised
        return [f"propose raised {type(exc).__name__}: {exc}"]
    problems = []
    if cand.choices.get("fallback"):
        problems.append(f"fallback {cand.choices['fallback']}: {'; '.join(cand.notes)[:200]}")
    ns: dict = {"__name__": "kl_candidate"}
    try:
        exec(compile(cand.source, spec.name, "exec"), ns)
        task = load_task(with_device_sizes(spec, device), validate=False)
        with torch.device("meta"):
            model = ns["ModelNew"](*task.get_init_inputs())
    except Exception as exc:  # noqa: BLE001
        return problems + [f"the candidate does not load: {type(exc).__name__}: {exc}"]
    cls = next(n for n in ast.parse(cand.source).body if isinstance(n, ast.ClassDef) and n.name == "ModelNew")
    for name in sorted(_free_names(cls)):
        if name not in ns and not hasattr(builtins, name):
            problems.append(f"reads the undefined name {name}")
    for path in sorted(_self_attributes(cls)):
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                problems.append(f"reads self.{path}, which the model lacks")
                break
            obj = getattr(obj, part)
    return problems


def test_fx_constant_is_defined_in_the_candidate(tmp_path, monkeypatch):
    spec = _fx_constant_spec(tmp_path)
    _stub_load_inline(monkeypatch)
    for device in ("cpu", "cuda"):
        cand = propose(spec, device, 0, 0, [])
        assert "_tensor_constant0" in cand.source and "self._tensor_constant0" not in cand.source
        assert "_kl_constant('_tensor_constant0', x.device)" in cand.source
        # on cuda the convolution's bias joins the epilogue; on cpu oneDNN adds it inside the convolution
        ops = ["add", "minimum", "add", "mul"] if device == "cuda" else ["minimum", "add", "mul"]
        assert ops in [g["ops"] for g in cand.choices["groups"]]
        assert candidate_problems(spec, device) == []




def test_fx_constant_builds_and_runs_on_cpu(tmp_path):
    """One real build: the constant is an operand of the fused kernel, and the result is the reference's."""
    spec = _fx_constant_spec(tmp_path)
    cand = propose(spec, "cpu", 0, 0, [])
    assert cand.choices["groups"] and not cand.choices.get("fallback")
    task, ref, new = reference_and_candidate(spec, cand.source)
    for seed in (1, 2):
        torch.manual_seed(seed)
        (x,) = task.get_inputs()
        with torch.no_grad():
            expect, got = ref(x), new(x)
            assert (ref.conv(x) > 0.25).any()          # the constant clips some values
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


DEVICE_SCALARS = FX_CONSTANT.replace(
    "x = torch.min(x, torch.tensor(self.constant_value))",
    "x = torch.min(x, torch.tensor(self.constant_value, device=x.device))\n"
    "        x = torch.maximum(torch.tensor(-0.5, device=x.device), x)\n"
    "        x = x - torch.tensor(0.125, device=x.device, dtype=torch.float32)\n"
    "        x = x * torch.tensor(3, device=x.device)")


def test_scalar_tensors_made_in_forward_fold_into_the_fused_kernel(tmp_path):
    """``torch.min(x, torch.tensor(c, device=x.device))`` (level2/93) traces to a call that depends on
    ``x`` through ``x.device``: folded to ``clamp_max(x, c)`` the chain stays one kernel. An integer
    tensor (``torch.tensor(3)``) is not folded (it stays on PyTorch and the kernel ends there); the
    candidate builds and computes the reference on the CPU, including where the input is NaN."""
    path = tmp_path / "conv_device_scalars.py"
    path.write_text(DEVICE_SCALARS)
    spec = read_spec(path, name="fixtures/conv_device_scalars")
    groups = {d: [g["ops"] for g in propose(spec, d, 0, 0, []).choices["groups"]] for d in ("cuda", "cpu")}
    # the convolution's bias (split off on cuda) and the three folded operators: one kernel
    assert ["add", "clamp_max", "clamp_min", "sub"] in groups["cuda"], groups
    assert ["clamp_max", "clamp_min", "sub"] in groups["cpu"], groups
    cand = propose(spec, "cpu", 0, 0, [])
    assert "torch.tensor(3, device=" in cand.source and "torch.tensor(0.125" not in cand.source
    task, ref, new = reference_and_candidate(spec, cand.source)
    torch.manual_seed(1)
    (x,) = task.get_inputs()
    x[0, 0, 0, 0] = float("nan")
    with torch.no_grad():
        expect, got = ref(x), new(x)
    assert expect.isnan().any()
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_generator_error_falls_back_with_its_reason(tmp_path, monkeypatch):
    import agent.builtin as builtin

    spec = _fx_constant_spec(tmp_path)

    def broken(*a, **k):
        raise KeyError("no template for this operator")

    monkeypatch.setattr(builtin, "_Generator", broken)
    cand = propose(spec, "cpu", 0, 0, [])
    assert cand.choices["fallback"] == "generator_error"
    assert "KeyError" in cand.choices["reason"] and "no template" in cand.choices["reason"]
    assert any("no template" in n for n in cand.notes)
    from agent.backends.builtin_backend import _sentence
    assert "no template" in _sentence(cand, "cpu")
    task, ref, new = reference_and_candidate(spec, cand.source)
    (x,) = task.get_inputs()
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x))


def _no_replay(monkeypatch) -> None:
    """Trace and render only: where the proposer replays its plan on real CPU tensors first
    (agent/builtin/replay.py), a KernelBench file has no CPU_SIZES and the replay would run at the
    published sizes (20 GB on this sweep)."""
    import importlib
    import importlib.util

    import agent.builtin as builtin

    if hasattr(builtin, "replay_verdict") and importlib.util.find_spec("agent.builtin.replay") is not None:
        verdict = importlib.import_module("agent.builtin.replay").Verdict
        monkeypatch.setattr(builtin, "replay_verdict", lambda spec, numerics=None, device="cpu": verdict())


def _kernelbench_files(level: str) -> list[Path]:
    from evals.kernelbench import kernelbench_root

    folder = kernelbench_root() / level
    if not folder.is_dir():
        pytest.skip(f"KernelBench is not at {kernelbench_root()} (set KERNELLOOP_KERNELBENCH)")
    return sorted(folder.glob("*.py"))


@pytest.mark.kernelbench
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("level", ["level1", "level2"])
def test_kernelbench_sweep_every_candidate_is_whole(level, device, monkeypatch):
    files = _kernelbench_files(level)
    assert len(files) >= 100
    _stub_load_inline(monkeypatch)
    _no_replay(monkeypatch)
    bad = {}
    for path in files:
        spec = read_spec(path, name=f"{level}/{path.stem}")
        problems = candidate_problems(spec, device)
        if problems:
            bad[spec.name] = problems
    assert not bad, f"{len(bad)} of {len(files)} {level} tasks on {device}:\n" + \
        "\n".join(f"{k}: {'; '.join(v)}" for k, v in bad.items())


@pytest.mark.parametrize("make", [lambda: nn.LSTM(10, 20, 2, batch_first=True, bidirectional=True),
                                  lambda: nn.LSTM(10, 20, 3, proj_size=5),
                                  lambda: nn.GRU(10, 20, 2, bidirectional=True),
                                  lambda: nn.RNN(10, 20, 1, nonlinearity="relu", batch_first=True)],
                         ids=["lstm-bidirectional-batch-first", "lstm-projected", "gru-bidirectional", "rnn-relu"])
@pytest.mark.parametrize("shape", [(4, 7, 10), (7, 10)], ids=["batched", "unbatched"])
def test_the_trace_gives_recurrent_layers_the_shapes_running_them_gives(make, shape):
    """The trace's shape propagation does not run nn.LSTM/GRU/RNN (on the meta device PyTorch
    decomposes every step: 44 s for level3/38_LSTMBidirectional); the shapes it gives instead are
    those of a real run, hidden states given or not; what the layer would refuse (an input of the
    wrong width, an initial state of None or of the wrong shape) is left to the layer, which raises."""
    from agent.builtin.trace import _recurrent_outputs

    module, x = make(), torch.randn(*shape)
    with torch.no_grad():
        real, fast = module(x), _recurrent_outputs(module, x.to("meta"))

    def shapes(out):
        state = out[1] if isinstance(out[1], tuple) else (out[1],)
        return [tuple(t.shape) for t in (out[0], *state)]

    assert shapes(fast) == shapes(real)
    assert fast[0].device.type == "meta"
    state = real[1]
    with torch.no_grad():
        again = module(x, state)                      # the final state given back as the initial one
    assert shapes(_recurrent_outputs(module, x, state)) == shapes(again)
    wrong = tuple(t[..., :-1] for t in state) if isinstance(state, tuple) else state[..., :-1]
    nones = (None, None) if isinstance(state, tuple) else (None,)
    for bad_x, bad_state in ((torch.randn(*shape[:-1], 11), None), (x, wrong), (x, nones)):
        assert _recurrent_outputs(module, bad_x, bad_state) is None            # left to the layer itself
        with pytest.raises(Exception):
            module(bad_x, bad_state)
