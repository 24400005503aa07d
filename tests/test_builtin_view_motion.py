"""Views moved out of the way of fusion (agent/builtin/view_motion.py): level2/38's add, clamp,
softmax and scale between two views ran as three kernels (0.67x torch.compile on an H200, session
ad); with the merging view hoisted to the convolution's output and the splitting one sunk to the
model's output they plan as one. Views the rule does not cover stay where they are."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate
from sandbox.tasks import read_spec

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"


def _spec(name: str):
    return read_spec(FIXTURES / f"{name}.py", name=f"fixtures/{name}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_softmax_between_two_views_is_one_kernel_with_its_neighbours(device):
    cand = generate(_spec("view_softmax"), device, Knobs(layout="nchw", graph="off"))
    groups = [g["ops"] for g in cand.choices["groups"]]
    # on cuda the convolution's bias is split off into the kernel (an add); on the CPU it stays in it
    first = ["add", "clamp"] if device == "cuda" else ["clamp"]
    assert groups == [first + ["mul", "softmax", "mul"]], groups
    assert cand.uncovered_ops == []
    assert ".flatten(2)" in cand.source            # the convolution's output, viewed for the kernel


def test_the_moved_views_compute_what_the_reference_does_in_the_cpu_sandbox():
    from builtin_candidate import judge
    from sandbox.result import Status

    cand = generate(_spec("view_softmax"), "cpu")
    result = judge(_spec("view_softmax"), cand.source, "cpu")
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)


def test_the_cuda_row_kernels_read_operands_fixed_along_a_row_at_its_first_element():
    """The per-channel bias and scale around the softmax are constant along each row it reduces: the
    row kernels index them at the row's first element (``base``, loop-invariant) instead of dividing
    every element's index (``cuda_reduce.cu.j2``; rows are reduced where ``inner == 1``)."""
    cand = generate(_spec("view_softmax"), "cuda", Knobs(layout="nchw", graph="off"))
    kernels = cand.source[cand.source.index("kl_g0 begin"):cand.source.index("kl_g0 end")]
    assert "_warp(" in kernels and "_regs(" in kernels        # the row kernels of the fixture's short rows
    assert "kl_off(base, r1p0)" in kernels and "kl_off(base, r2p0)" in kernels
    assert "kl_off(i, " not in kernels


@pytest.mark.gpu
def test_the_moved_views_and_row_operands_are_correct_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from builtin_candidate import judge
    from sandbox.result import Status

    for layout in ("nchw", "nhwc"):
        cand = generate(_spec("view_softmax"), "cuda", Knobs(layout=layout))
        result = judge(_spec("view_softmax"), cand.source, "cuda")
        assert result.status is Status.correct, (layout, result.status, result.error_message)


def test_views_the_rule_does_not_cover_stay_and_the_kernels_stay_apart():
    cand = generate(_spec("view_kept"), "cpu", Knobs(graph="off"))
    groups = [g["ops"] for g in cand.choices["groups"]]
    # each softmax a kernel of its own, not fused with what precedes its view
    assert sum(ops == ["softmax"] for ops in groups) == 3, groups
    assert cand.source.count(".view(2, 4, -1)") == 3
    # the input's view stays before the sigmoid, which stays the mean's prologue (sunk, the view
    # would part them: the first rule's mistake, caught by tests/test_builtin_narrow_index.py)
    assert ["sigmoid", "mean"] in groups and "w.view(2, 4, 15)" in cand.source


@pytest.mark.kernelbench
def test_level2_38_is_two_kernels_around_its_convolution():
    from evals.kernelbench import kernelbench_root

    name = "38_ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply"
    spec = read_spec(kernelbench_root() / "level2" / f"{name}.py", name=f"level2/{name}")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    assert [g["ops"] for g in cand.choices["groups"]] == [["avg_pool3d"], ["add", "clamp", "softmax", "mul"]]
