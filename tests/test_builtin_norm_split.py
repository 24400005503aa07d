"""Norm statistics split over several blocks per row on cuda (cuda_norm.cu.j2's _part/_fin,
``kernels.norm_split_on``): rendered only where switched on and for one-pass statistics,
judged on a GPU (the GPU test) and built by nvcc (tests/test_cuda_builds.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate
from agent.builtin.kernels import NORM_SPLIT_ENV
from sandbox.tasks import read_spec, with_device_sizes

FIXTURE = Path(__file__).parent / "fixtures" / "builtin" / "norm_split.py"


def _spec():
    return read_spec(FIXTURE, name="fixtures/norm_split")


def _norms(cand) -> list[list[str]]:
    return [g["ops"] for g in cand.choices["groups"] if g["kind"] == "norm"]


def test_the_split_kernels_render_only_where_switched_on_and_one_pass(monkeypatch):
    monkeypatch.delenv(NORM_SPLIT_ENV, raising=False)
    off = generate(_spec(), "cuda", Knobs(layout="nchw"))
    assert len(_norms(off)) == 4 and "_part" not in off.source          # off by default
    monkeypatch.setenv(NORM_SPLIT_ENV, "1")
    on = generate(_spec(), "cuda", Knobs(layout="nchw"))
    assert _norms(on) == _norms(off)                                    # the same groups, other kernels
    for g in on.choices["groups"]:
        name = g["name"]
        assert f"{name}_part<int><<<" in on.source and f"{name}_fin<int><<<" in on.source
        assert f"{name}_block<int><<<" in on.source                     # many rows still take the block kernel
    # the running buffers are updated once per row, by the first chunk's block
    assert "if (update && blockIdx.y == 0)" in on.source
    compile(on.source, "cuda_candidate.py", "exec")
    # two-pass statistics (reduce=twopass) keep one block per row
    two = generate(_spec(), "cuda", Knobs(layout="nchw", reduce="twopass"))
    assert "_part" not in two.source
    # the CPU target has its own kernels: unchanged
    assert "_part" not in generate(_spec(), "cpu").source


def test_the_fixture_is_judged_correct_on_the_cpu():
    """The fixture itself (prologue, four norms, epilogue) through the CPU sandbox."""
    from builtin_candidate import judge
    from sandbox.result import Status

    spec = _spec()
    result = judge(spec, generate(spec, "cpu").source, "cpu")
    assert result.status is Status.correct and result.clean, (result.status, result.error_message, result.flags)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["0", "1"])
def test_split_norm_kernels_are_correct_on_a_gpu(monkeypatch, split):
    """Each norm's rows (4-8, fewer than the SMs) split into chunks or not, judged by the sandbox on a
    GPU: every output against the reference."""
    from builtin_candidate import judge
    from sandbox.result import Status

    monkeypatch.setenv(NORM_SPLIT_ENV, split)
    spec = with_device_sizes(_spec(), "cuda")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    assert ("_part<int><<<" in cand.source) == (split == "1")
    result = judge(spec, cand.source, "cuda")
    assert result.status is Status.correct and result.clean, (result.status, result.error_message, result.flags)
    assert all(o.mismatched == 0 for t in result.trials for o in t.outputs)


@pytest.mark.gpu
def test_split_batch_norm_updates_its_running_buffers_and_reads_them_in_eval_mode(monkeypatch):
    """The sandbox compares outputs only: BatchNorm's running buffers after two training-mode
    forwards (updated once per row, by chunk 0's block) and an eval-mode forward (the running
    statistics, no partials) are compared here, in one process."""
    import torch

    from sandbox.tasks import load_task

    monkeypatch.setenv(NORM_SPLIT_ENV, "1")
    spec = _spec()
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    ns: dict = {}
    exec(compile(cand.source, "norm_split_candidate.py", "exec"), ns)
    task = load_task(spec)
    torch.manual_seed(0)
    ref = task.Model(*task.get_init_inputs()).cuda()
    torch.manual_seed(0)
    new = ns["ModelNew"](*task.get_init_inputs()).cuda()
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            x = task.get_inputs()[0].cuda()
            torch.testing.assert_close(new(x), ref(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(new.bn.running_mean, ref.bn.running_mean, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(new.bn.running_var, ref.bn.running_var, atol=1e-5, rtol=1e-4)
        assert int(new.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 2
        ref.eval()
        new.eval()
        torch.manual_seed(3)
        x = task.get_inputs()[0].cuda()
        torch.testing.assert_close(new(x), ref(x), atol=1e-4, rtol=1e-4)
