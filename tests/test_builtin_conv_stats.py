"""A batch norm's statistics summed by the direct convolution before it (agent/builtin/conv_stats.py):
which groups are linked, what the candidate passes between them, and (GPU) that the outputs and the
running buffers match the reference's. nvcc builds it in tests/test_cuda_builds.py (``stats:``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate
from sandbox.tasks import read_spec, with_device_sizes

FIXTURE = Path(__file__).parent / "fixtures" / "builtin" / "conv_bn.py"


def _spec():
    return read_spec(FIXTURE, name="fixtures/conv_bn")


def _calls(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if "_ext.kl_g" in line]


def test_each_batch_norm_takes_its_statistics_from_the_convolution_before_it():
    cand = generate(_spec(), "cuda", Knobs(layout="nchw", conv="direct"))
    kinds = [g["kind"] for g in cand.choices["groups"]]
    assert kinds == ["conv", "norm"] * 3
    calls = _calls(cand.source)
    for conv, norm in (("kl_g0", "kl_g1"), ("kl_g2", "kl_g3"), ("kl_g4", "kl_g5")):
        # the convolution returns (output, statistics); the norm takes them after its tensors
        assert any(f", _kl_stats_{conv} = _ext.{conv}(" in c for c in calls), calls
        assert any(f"_ext.{norm}(" in c and f"_kl_stats_{conv}, bool(_bn.training)" in c for c in calls), calls
    src = cand.source
    assert src.count("std::tuple<torch::Tensor, torch::Tensor> kl_g") == 3
    assert src.count(", float* __restrict__ stats") == 3                  # each convolution kernel writes them
    assert src.count("const float* given = static_cast<const float*>(ins[") == 3
    # a warp's partial per tile: one a register-blocked tile (c8x8), one per warp row in the FMA tile (the
    # strided convolution's: 4x8, wy = 4)
    slots = [line.strip() for line in src.splitlines() if "const int64_t stats_slots =" in line]
    assert [s.rsplit("* ", 1)[1] for s in slots] == ["1;", "4;", "1;"], slots
    assert "sp[0] = st_mean; sp[1] = st_q; sp[2] = st_n;" in src
    compile(src, "conv_bn_candidate.py", "exec")


def test_the_statistics_pass_stays_where_the_search_or_the_target_asks_for_it():
    spec = _spec()
    # fusion=no_prologue: the norm's own statistics (the search measures both)
    apart = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", fusion="no_prologue"))
    assert "_kl_stats" not in apart.source and "const float* given" not in apart.source
    # cuDNN's convolution, and the CPU target: nothing to link
    assert "_kl_stats" not in generate(spec, "cuda", Knobs(layout="nchw")).source
    assert "_kl_stats" not in generate(spec, "cpu", Knobs(layout="nchw", conv="direct")).source
    # the tensor-core tile does not sum them: the linked convolutions fall back to the FMA tile
    mma = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", conv_tile="3xtf32"))
    assert "mma.sync" not in mma.source and mma.source.count("_kl_stats_kl_g") == 6


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["c8x8", "c4x8", "4x8"])
def test_the_statistics_from_the_convolution_are_correct_on_a_gpu(tile):
    """Judged by the sandbox (every output checked), then the running buffers after two training-mode
    forwards and an eval-mode forward, against the reference's, in one process."""
    import torch

    from builtin_candidate import assert_judged_correct, judge, reference_and_candidate

    spec = with_device_sizes(_spec(), "cuda")
    cand = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", conv_tile=tile))
    assert cand.source.count("_kl_stats_kl_g") == 6
    result = judge(spec, cand.source, "cuda")
    assert_judged_correct(result)
    task, ref, new = reference_and_candidate(spec, cand.source)
    ref, new = ref.cuda(), new.cuda()
    torch.manual_seed(1)
    inputs = [x.cuda() for x in task.get_inputs()]
    with torch.no_grad():
        for _ in range(2):
            for want, got in zip(ref(*inputs), new(*inputs)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for name in ("bn", "bn_s", "bn_v"):
            a, b = getattr(ref, name), getattr(new, name)
            torch.testing.assert_close(b.running_mean, a.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b.running_var, a.running_var, rtol=1e-5, atol=1e-6)
        ref.eval()
        new.eval()
        for want, got in zip(ref(*inputs), new(*inputs)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
