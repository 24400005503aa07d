"""Recurrent layers in kernels of their own (agent/builtin/recurrent.py): nn.LSTM, nn.GRU and nn.RNN
calls matched in the traced graph, the library variant, what stays the library's call, the
float64 replay, and the fused candidate built and judged in the CPU sandbox (fp32 tolerance,
float64 rule) - right where it is right, incorrect where a kernel is planted wrong."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate, propose, replay_verdict
from sandbox.tasks import read_spec, with_device_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
MIX = FIXTURES / "recurrent_mix.py"
NAMES = ["lstm1", "lstm2", "gru1", "gru2", "rnn", "rnn_relu"]
OPS = [["lstm"], ["lstm"], ["gru"], ["gru"], ["rnn_tanh"], ["rnn_relu"]]

UNSUPPORTED = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.projected = nn.LSTM(5, 8, 1, proj_size=3)
        self.dropped = nn.GRU(5, 8, 2, dropout=0.5)
        self.unbatched = nn.RNN(5, 8)

    def forward(self, x, u):
        a, _ = self.projected(x)
        b, _ = self.dropped(x)
        c, _ = self.unbatched(u)
        return a, b, c

def get_inputs():
    return [torch.randn(4, 2, 5), torch.randn(4, 5)]

def get_init_inputs():
    return []
'''


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _spec(path: Path):
    return read_spec(path, name=f"fixtures/{path.stem}")


def _forward_code(source: str) -> str:
    return "\n".join(line for line in source.split("def forward")[1].splitlines() if not line.strip().startswith("#"))


def test_each_recurrent_layer_becomes_one_kernel_named_in_the_header():
    cand = generate(_spec(MIX), "cpu")
    groups = cand.choices["groups"]
    assert [g["kind"] for g in groups] == ["recurrent"] * 6
    assert [g["nodes"] for g in groups] == [[n] for n in NAMES]
    assert [g["ops"] for g in groups] == OPS
    assert cand.choices["knobs"]["recurrent"] == "fused"
    assert "LSTM" not in cand.choices["library"] and "GRU" not in cand.choices["library"]
    code = _forward_code(cand.source)
    assert not re.search(r"self\.(lstm|gru|rnn)\w*\(", code)        # no layer is called
    assert "v_lstm2 = _ext.kl_g1(v_transpose, [h2, c2], [_p for _ps in self.lstm2.all_weights for _p in _ps])" in code
    assert "v_lstm1 = _ext.kl_g0(x, [], " in code                   # no initial state: zeros
    assert "v_gru2 = (v_gru2[0], v_gru2[1])" in code
    assert cand.source.count("_cpu_dir(const float*") == 6
    # the CUDA candidate renders too: one cooperative persistent launch per layer, the library's layer as fallback
    cuda = generate(_spec(MIX), "cuda")
    assert [g["ops"] for g in cuda.choices["groups"]] == OPS
    assert cuda.source.count("cudaLaunchCooperativeKernel(") == 6
    assert "at::lstm(x, {h0, c0}, weights, true, L" in cuda.source and "at::rnn_relu(x, h0, weights, false, L" in cuda.source
    compile(cuda.source, "cuda_candidate.py", "exec")


def test_the_library_variant_keeps_the_layers_and_is_the_second_sample():
    spec = _spec(MIX)
    lib = generate(spec, "cpu", Knobs(recurrent="library"))
    assert lib.choices["knobs"]["recurrent"] == "library" and lib.choices["groups"] == []
    assert "v_lstm2 = self.lstm2(v_transpose, (h2, c2))" in lib.source
    first, second = propose(spec, "cpu", 0, 0, []), propose(spec, "cpu", 0, 1, [])
    assert first.choices["knobs"]["recurrent"] == "fused"
    assert second.choices["knobs"]["recurrent"] == "library"


def test_unsupported_layers_keep_the_library_call(tmp_path):
    """proj_size, dropout between layers and an unbatched input: the library's layer, never a kernel."""
    path = tmp_path / "unsupported.py"
    path.write_text(UNSUPPORTED)
    cand = generate(read_spec(path, name="fixtures/unsupported"), "cpu")
    assert cand.choices["groups"] == [] and cand.choices["knobs"]["recurrent"] == "fused"
    code = _forward_code(cand.source)
    for call in ("self.projected(x)", "self.dropped(x)", "self.unbatched(u)"):
        assert call in code


def test_a_model_without_recurrent_layers_normalises_the_knob():
    lib = generate(_spec(FIXTURES / "attention_pair.py"), "cpu", Knobs(recurrent="library"))
    assert lib.choices["knobs"]["recurrent"] == "fused"


def test_the_replay_checks_the_kernels_and_catches_a_wrong_one(monkeypatch):
    spec = _spec(MIX)
    verdict = replay_verdict(spec)
    assert verdict.ran and not verdict.excluded, verdict.notes
    # plant a planning bug: GRU's update gate weighing the new state instead of the old one
    from agent.builtin import recurrent

    real = recurrent._cell

    def wrong(op, xg, hg, h, c):
        if op != "gru":
            return real(op, xg, hg, h, c)
        z = torch.sigmoid(xg.chunk(3, -1)[1] + hg.chunk(3, -1)[1])
        n, _ = real(op, xg, hg, h, c)
        return z * n + (1 - z) * h, None

    monkeypatch.setattr(recurrent, "_cell", wrong)
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})
    verdict = replay_verdict(spec)
    assert verdict.semantic == ["kl_g2", "kl_g3"], verdict.notes
    assert verdict.excluded == {"gru1", "gru2"}


def _judge(source: str, device: str = "cpu"):
    from builtin_candidate import judge

    return judge(_spec(MIX), source, device)


def test_the_recurrent_kernels_are_correct_in_the_cpu_sandbox():
    """One C++ build: the six layers (LSTM, GRU, RNN tanh and relu; one and two layers; bidirectional;
    batch_first or not; states given or zeros) judged by the sandbox against the reference
    (fp32 tolerance, float64 rule): every output, h_n and c_n."""
    from sandbox.result import Status

    cand = propose(with_device_sizes(_spec(MIX), "cpu"), "cpu", 0, 0, [])
    assert [g["ops"] for g in cand.choices["groups"]] == OPS
    result = _judge(cand.source)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and len(checks) % 14 == 0 and all(c.mismatched == 0 for c in checks)
    assert all(c.ref_fp64_rel_rms is not None for c in checks[:14])       # the float64 reference ran


def test_a_wrong_kernel_is_judged_incorrect():
    """The same judgement fails a kernel planted wrong (GRU's state update with n's sign flipped):
    the test above can fail."""
    from sandbox.result import Status

    cand = propose(with_device_sizes(_spec(MIX), "cpu"), "cpu", 0, 0, [])
    right = "const float y = n + z * (hb[j] - n);"
    assert cand.source.count(right) == 2
    result = _judge(cand.source.replace(right, "const float y = n + z * (hb[j] + n);"))
    assert result.status is Status.incorrect, (result.status, result.error_message)


@pytest.mark.gpu
def test_the_recurrent_kernels_are_correct_on_cuda():
    """The CUDA time loops (cuda_rnn.cu.j2: persistent cooperative kernels, grid barriers) judged by
    the sandbox on a GPU: the six layers of the fixture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status

    spec = _spec(MIX)
    cand = propose(spec, "cuda", 0, 0, [])
    assert [g["ops"] for g in cand.choices["groups"]] == OPS
    cfg = EvalConfig(numerics=Numerics(), trials=3, warmup_runs=1, timed_runs=3, time_compile=False, profile=False)
    result = evaluate(spec, cand.source, "cuda", cfg)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)


def test_parameters_left_to_their_defaults_are_traced_with_them():
    """A forward whose optional initial states get_inputs() leaves to None, drawn inside it with
    torch.randn (level3/35_LSTM): traced with the defaults, the draws kept on PyTorch in the
    reference's order, the LSTM one kernel; judged correct in the CPU sandbox; the candidate
    refuses states it was not generated for."""
    import torch

    from builtin_candidate import judge
    from sandbox.result import Status

    spec = read_spec(FIXTURES / "default_states.py", name="fixtures/default_states")
    cand = generate(spec, "cpu")
    assert [g["kind"] for g in cand.choices["groups"]] == ["recurrent"]
    assert cand.choices["library"].count("randn") == 2 and cand.choices["uncovered"] == []
    assert "def forward(self, x, h0=None, c0=None):" in cand.source
    result = judge(spec, cand.source, "cpu")
    assert result.status is Status.correct, (result.status, result.error_message, result.flags)
    ns: dict = {}
    exec(compile(cand.source, "default_states_candidate.py", "exec"), ns)
    model = ns["ModelNew"](8, 16, 2, 5)
    with pytest.raises(ValueError, match="h0 has been specialized"):
        model(torch.randn(3, 7, 8), torch.zeros(2, 3, 16))


@pytest.mark.kernelbench
def test_kernelbench_35_lstm_gets_its_recurrent_kernel():
    from evals.kernelbench import kernelbench_paths

    path, = kernelbench_paths(["level3/35_LSTM"])
    cand = generate(read_spec(path, name="level3/35_LSTM"), "cuda")
    assert [g["kind"] for g in cand.choices["groups"]] == ["recurrent"] and "fallback" not in cand.choices
