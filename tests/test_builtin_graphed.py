"""The ``graph`` knob (``agent/builtin/graphed.py``): where the CUDA-graph replay is offered, what the
candidate's forward becomes, the graph-free twin as round 0's second candidate, and on a GPU the
replay judged correct, its batch-norm buffers updated once per call and a replay that skips the
input copy judged incorrect."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.builtin import generate, propose
from agent.builtin.codegen import Knobs
from sandbox.tasks import read_spec

NET = Path(__file__).parent / "fixtures" / "builtin" / "graph_net.py"


def _spec(tmp_path: Path | None = None, edit=None, **overrides):
    path = NET
    if edit is not None:
        path = tmp_path / "graph_edit.py"
        path.write_text(edit(NET.read_text()))
    return read_spec(path, overrides, name="fixtures/graph_net")


def test_a_launch_bound_network_is_replayed_from_a_graph_on_cuda_only():
    cand = generate(_spec(), "cuda")
    assert cand.choices["knobs"]["graph"] == "replay"
    src = cand.source
    assert "    def _kl_forward(self, x):" in src
    assert "        return _kl_graphed(self, self._kl_forward, (x,))" in src
    assert "def _kl_capture(model, fn, args):" in src and "torch.cuda.CUDAGraph()" in src
    compile(src, "candidate.py", "exec")
    off = generate(_spec(), "cuda", Knobs(graph="off"))
    assert off.choices["knobs"]["graph"] == "off" and "_kl_graphed" not in off.source
    assert "    def forward(self, x):" in off.source
    cpu = generate(_spec(), "cpu")
    assert cpu.choices["knobs"]["graph"] == "off" and "_kl_graphed" not in cpu.source


def test_round_zero_measures_the_graph_against_its_graph_free_twin():
    first, second = (propose(_spec(), "cuda", 0, s, []) for s in (0, 1))
    k0, k1 = first.choices["knobs"], second.choices["knobs"]
    assert (k0["graph"], k1["graph"]) == ("replay", "off")
    assert {n for n in k0 if k0[n] != k1[n]} == {"graph"}


def _seen(cand, attempt_id: int, ms: float, *flags: str, sample: int = 0):
    from agent.types import AttemptView
    from sandbox.result import EvalResult, Flag, FlagKind, Status, Timing

    t = Timing(median_ms=ms, iqr_ms=0.01, mean_ms=ms, min_ms=ms, max_ms=ms, runs=20, clock="cuda_event")
    result = EvalResult(status=Status.correct, task="fixtures/graph_net", device="cuda", candidate_time=t,
                        speedup_eager=2.0 / ms, flags=[Flag(kind=FlagKind(f), reason="test") for f in flags])
    return AttemptView(attempt_id=attempt_id, round=0, sample=sample, parse_status="ok", source=cand.source,
                       result=result)


def test_a_candidate_only_flagged_contended_is_measured_once_more():
    """Session x: 7_GoogleNetInceptionV1's graph candidate met a GPU slow for seconds and was flagged
    ``contended`` (the harness's condition, not the candidate's); round 1 then measured its twin (0.48x
    eager), which became the clean best. Now round 1's first sample measures the same source again
    (its header says so), the second takes the next variant; once measured twice, or where a clean
    attempt is faster, or it measured slower than eager, or flagged for anything else, it is not
    measured again."""
    from agent.builtin.codegen import body_hash

    graph, twin = (propose(_spec(), "cuda", 0, s, []) for s in (0, 1))
    history = [_seen(graph, 1, 0.5, "contended"), _seen(twin, 2, 1.5, sample=1)]
    again, other = (propose(_spec(), "cuda", 1, s, history) for s in (0, 1))
    assert body_hash(again.source) == body_hash(graph.source)
    assert again.choices["repeat"] is True and again.choices["remeasure"] == 1
    assert body_hash(other.source) not in {body_hash(graph.source), body_hash(twin.source)}
    assert "remeasure" not in other.choices
    assert "attempt 1 (correct, flagged contended only): measured again" in again.notes
    for later in ([*history, _seen(again, 3, 0.6, "contended")],                  # measured twice
                  [_seen(graph, 1, 0.5, "contended"), _seen(twin, 2, 0.4, sample=1)],   # a clean one is faster
                  [_seen(graph, 1, 0.5, "contended", "suspicious"), _seen(twin, 2, 1.5, sample=1)],
                  [_seen(graph, 1, 2.5, "contended"), _seen(twin, 2, 3.0, sample=1)]):  # slower than eager
        nxt = propose(_spec(), "cuda", 2, 0, later)
        assert "remeasure" not in nxt.choices and body_hash(nxt.source) != body_hash(graph.source)


@pytest.mark.parametrize("edit, why", [
    (lambda s: s.replace("x = F.relu(x + y)", "x = F.relu(x + F.dropout(y, 0.1))"), "draws random numbers"),
    (lambda s: s.replace("        return torch.tanh", "        self.last = x\n        return torch.tanh"),
     "assigns a module attribute"),
    (lambda s: s.replace("self.bn1 = nn.BatchNorm2d(channels)", "self.bn1 = nn.BatchNorm2d(channels, momentum=None)"),
     "reads its step count on the host"),
], ids=["dropout", "rebind", "momentum-none"])
def test_not_offered_where_a_replay_would_differ_from_the_forward(tmp_path, edit, why):
    cand = generate(_spec(tmp_path, edit), "cuda")
    assert cand.choices["knobs"]["graph"] == "off", why
    assert "_kl_graphed" not in cand.source


def test_not_offered_where_the_copies_outweigh_the_launches():
    """Inputs and outputs copied per call: a large image is not worth a graph (level 2's sizes)."""
    big = generate(_spec(batch_size=16, size=1024), "cuda")         # 200 MB of input for ~12 launches
    assert big.choices["knobs"]["graph"] == "off"


def test_not_offered_for_a_forward_of_few_launches(tmp_path):
    few = "\n".join([
        "import torch", "import torch.nn as nn", "",
        "class Model(nn.Module):",
        "    def __init__(self):", "        super().__init__()", "        self.fc = nn.Linear(8, 8)", "",
        "    def forward(self, x):", "        return torch.relu(self.fc(x))", "",
        "def get_inputs():", "    return [torch.rand(2, 8)]", "",
        "def get_init_inputs():", "    return []", ""])
    path = tmp_path / "few.py"
    path.write_text(few)
    cand = generate(read_spec(path, {}, name="fixtures/few"), "cuda")
    assert cand.choices["groups"] and cand.choices["knobs"]["graph"] == "off"


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_the_replay_is_judged_correct_and_its_kernels_are_its_own():
    """The sandbox judges the graph candidate: correct, no no-custom-kernel flag, its own kernels in
    the profile (replayed); the same candidate replaying without copying the call's inputs in
    (the first call's output for every input) is judged incorrect."""
    _cuda()
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, FlagKind, Status

    spec = _spec()
    cand = propose(spec, "cuda", 0, 0, [])
    assert cand.choices["knobs"]["graph"] == "replay"
    cfg = EvalConfig(numerics=Numerics(), trials=3, warmup_runs=2, timed_runs=5, time_compile=False, profile=True)
    result = evaluate(spec, cand.source, "cuda", cfg)
    assert result.status is Status.correct, (result.status, result.error_message, result.stderr[-2000:])
    assert not any(f.kind == FlagKind.no_custom_kernel for f in result.flags), result.flags
    assert any(k.own for k in result.profile), result.profile       # its kernels ran, from the graph
    stale = cand.source.replace("        s.copy_(a)\n", "        pass\n")
    assert stale != cand.source
    wrong = evaluate(spec, stale, "cuda", cfg)
    assert wrong.status is Status.incorrect, (wrong.status, wrong.error_message)


@pytest.mark.gpu
def test_the_replay_updates_the_buffers_once_per_call_and_keeps_earlier_outputs():
    """Three calls on fresh inputs: outputs as the reference's, batch norm's running statistics and
    step counts as the reference's after each call (the warm-ups undone), and the first call's
    output unchanged by the later replays (outputs are clones). Then in eval mode (the running
    statistics: a graph of its own) and after a move away and back (the graphs dropped)."""
    _cuda()
    import types

    from sandbox.harness import make_model
    from sandbox.tasks import load_task

    spec = _spec()
    task = load_task(spec)
    cand = propose(spec, "cuda", 0, 0, [])
    mod = types.ModuleType("graph_candidate")
    exec(compile(cand.source, "graph_candidate.py", "exec"), mod.__dict__)
    ref = make_model(task.namespace["Model"], task, 0, "cuda", None)
    new = make_model(mod.ModelNew, task, 0, "cuda", None)
    outs = []
    with torch.no_grad():
        for i in range(3):
            torch.manual_seed(100 + i)
            x = torch.rand(4, 3, 8, 8, device="cuda")
            want, got = ref(x), new(x)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            outs.append((got, got.clone()))
            for (name, a), (_, b) in zip(ref.named_buffers(), new.named_buffers()):
                torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name} after call {i}: {m}")
    assert new.__dict__.get("_kl_graphs") and not any(isinstance(e, str) for e in new._kl_graphs.values())
    for got, copy in outs:
        assert torch.equal(got, copy)
    # eval mode after training-mode replays: the running statistics, not a replay of the batch's
    # (a graph per training flags); then moved away and back: the graphs read no freed tensor
    ref.eval()
    new.eval()
    with torch.no_grad():
        for step in ("eval", "moved"):
            if step == "moved":
                new.cpu().cuda()
                assert not new.__dict__.get("_kl_graphs")
            torch.manual_seed(7)
            x = torch.rand(4, 3, 8, 8, device="cuda")
            torch.testing.assert_close(new(x), ref(x), rtol=1e-3, atol=1e-3, msg=lambda m: f"{step}: {m}")
            torch.testing.assert_close(new(x), ref(x), rtol=1e-3, atol=1e-3, msg=lambda m: f"{step}, replayed: {m}")
