"""An Elman RNN written as a Python loop (level3/34_VanillaRNNHidden), unrolled by the trace, runs as
one recurrent layer (``agent/builtin/unrolled_rnn.py``): built and judged on the CPU, the replay
clean, and what the matcher refuses."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import generate, propose, replay_verdict
from agent.builtin.codegen import Knobs
from agent.builtin.unrolled_rnn import MIN_STEPS
from sandbox.tasks import read_spec

from remeasure import remeasured

LOOP = Path(__file__).parent / "fixtures" / "builtin" / "rnn_loop.py"


def _spec(steps: int, tmp_path: Path | None = None, edit=None):
    path = LOOP
    if edit is not None:
        path = tmp_path / "rnn_edit.py"
        path.write_text(edit(LOOP.read_text()))
    return read_spec(path, {"sequence_length": steps}, name=f"fixtures/rnn_loop_{steps}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_long_unrolled_loop_is_one_recurrent_kernel_and_h2o_one_gemm(device):
    cand = generate(_spec(MIN_STEPS + 4), device)
    groups = cand.choices["groups"]
    assert [(g["kind"], g["ops"]) for g in groups] == [("recurrent", ["rnn_tanh", "linear"])]
    assert len(groups[0]["nodes"]) == 5 * (MIN_STEPS + 4) + 1          # getitem, cat, i2h, tanh, h2o per step; the stack
    assert "functions=['kl_g0']" in cand.source and cand.source.count("_ext.kl_g0(") == 1
    assert "self.i2h.weight[:, :8], self.i2h.weight[:, 8:], self.i2h.bias" in cand.source
    assert "torch.nn.functional.linear(v_stack_seq[0], self.h2o.weight, self.h2o.bias)" in cand.source
    assert cand.choices["knobs"]["recurrent"] == "fused"


def test_a_short_loop_keeps_a_kernel_per_step():
    cand = generate(_spec(MIN_STEPS - 1), "cpu")
    assert {g["kind"] for g in cand.choices["groups"]} == {"ew"}


@pytest.mark.parametrize("edit", [
    lambda s: s.replace("torch.cat((x[t], hidden), dim=1)", "torch.cat((hidden, x[t]), dim=1)"),     # other order
    lambda s: s.replace("hidden = self.tanh(self.i2h(combined))", "hidden = torch.relu(self.i2h(combined))"),
    lambda s: s.replace("outputs.append(output)", "outputs.append(output + hidden.sum())"),         # h read again
    lambda s: s.replace("        return torch.stack(outputs, dim=0)",
                        "        self.last = hidden\n        return torch.stack(outputs, dim=0)"),   # state kept on the model
], ids=["cat-order", "relu", "h-read-twice", "h-assigned"])
def test_what_is_not_the_elman_cell_is_not_matched(tmp_path, edit):
    cand = generate(_spec(MIN_STEPS + 2, tmp_path, edit), "cpu")
    assert not any(g["kind"] == "recurrent" for g in cand.choices["groups"])


def test_the_replay_is_clean_and_the_candidate_is_correct_in_the_cpu_sandbox():
    """The replay runs the candidate with the kernel emulated (float64 and PyTorch's bits); one
    C++ build judged by the sandbox against the reference; the time loop planted wrong (the
    recurrent product dropped from one step on) is judged incorrect."""
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status

    spec = _spec(MIN_STEPS + 4)
    verdict = replay_verdict(spec)
    assert verdict.ran and not verdict.semantic and not verdict.unverifiable, verdict.notes
    cand = propose(spec, "cpu", 0, 0, [])
    assert cand.choices["groups"][0]["kind"] == "recurrent"
    cfg = EvalConfig(numerics=Numerics(), trials=2, warmup_runs=1, timed_runs=2, time_compile=False, profile=False)
    result = remeasured(lambda: evaluate(spec, cand.source, "cpu", cfg))
    assert result.status is Status.correct and result.clean, (result.status, result.error_message, result.flags)
    wrong_src = cand.source.replace("torch.zeros_like(self.i2h.bias)", "torch.full_like(self.i2h.bias, 0.01)")
    assert wrong_src != cand.source
    wrong = evaluate(spec, wrong_src, "cpu", cfg)
    assert wrong.status is Status.incorrect, (wrong.status, wrong.error_message)


def test_the_library_variant_keeps_the_loop_as_written():
    cand = generate(_spec(MIN_STEPS + 4), "cpu", Knobs(recurrent="library"))
    assert not any(g["kind"] == "recurrent" for g in cand.choices["groups"])
    assert "self.i2h(" in cand.source and "self.h2o(" in cand.source
