"""``clone`` and ``detach`` in the builtin's catalogue (level2/20: ``x.clone().detach()`` of a
convolution's output stayed on PyTorch, a whole copy of the output and the convolution's bias left
unsplit): ``clone`` is an elementwise copy that fuses, ``detach`` an alias; a copy taken before an
in-place update of its source keeps the value from before."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate
from sandbox.tasks import read_spec

FIXTURE = Path(__file__).parent / "fixtures" / "builtin" / "clone_detach.py"


def _spec():
    return read_spec(FIXTURE, name="fixtures/clone_detach")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_clone_is_a_fused_copy_and_detach_an_alias(device):
    cand = generate(_spec(), device, Knobs(graph="off"))      # (the graph replay clones its outputs)
    assert not any(op in ("clone", "detach") for op in cand.uncovered_ops), cand.uncovered_ops
    assert ".clone()" not in cand.source and ".detach()" not in cand.source
    groups = [g["ops"] for g in cand.choices["groups"]]
    assert ["add", "add", "mul", "add"] in groups and ["copy"] in groups, groups
    # the in-place update of the copy's source stays on PyTorch (its source is read after it)
    assert cand.uncovered_ops == ["mul"]


def test_copies_are_correct_in_the_cpu_sandbox():
    from builtin_candidate import judge
    from sandbox.result import Status

    cand = generate(_spec(), "cpu")
    result = judge(_spec(), cand.source, "cpu")
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)


@pytest.mark.kernelbench
def test_level2_20_is_one_kernel_after_its_convolution():
    """The convolution's bias split off and every operator after it in one kernel: the output is read
    once (it was copied by PyTorch, its bias added by PyTorch, then read by the kernel)."""
    from evals.kernelbench import kernelbench_root

    name = "20_ConvTranspose3d_Sum_ResidualAdd_Multiply_ResidualAdd"
    spec = read_spec(kernelbench_root() / "level2" / f"{name}.py", name=f"level2/{name}")
    for layout in ("nhwc", "nchw"):
        cand = generate(spec, "cuda", Knobs(layout=layout))
        assert cand.uncovered_ops == []
        assert [g["ops"] for g in cand.choices["groups"]] == [["add", "copy", "add", "add", "mul", "add"]]
        assert "None, (2, 2, 2)" in cand.source           # conv_transpose3d without its bias
