"""Direct convolution (agent/builtin/conv.py): small-K Conv2d/Conv3d + the elementwise chains around
them as one generated kernel under ``conv=direct``, judged in the CPU sandbox (with and without
bias, stride 2 / padding 1, dilation 2, a prologue whose f(0) is not 0, 3-D); a kernel planted
wrong judged incorrect; convolutions the kernels do not reproduce, the ``library`` variant and
the channels-last layout keep cuDNN/oneDNN; the CUDA candidates render (built on a GPU by
scripts/gpu_conv_check.py); a sum or mean over the spatial dims ends a conv group as its tail
(conv_tail.py), judged on the CPU and, ``-m gpu``, on CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate, propose
from agent.builtin.conv import CUDA_CONV_ENV, DEFAULT_TILE, MMA_TILE, SLIDE_TILES, TILES
from sandbox.tasks import read_spec, with_device_sizes

FIXTURE = Path(__file__).parent / "fixtures" / "builtin" / "conv_direct.py"
DIRECT = Knobs(layout="nchw", conv="direct")

UNSUPPORTED = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(4, 4, 3, groups=2)
        self.wide = nn.Conv2d(16, 8, 3)
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.transposed = nn.ConvTranspose2d(4, 4, 3)
        self.same = nn.Conv2d(4, 4, 3, padding="same")

    def forward(self, x, y):
        a = torch.relu(self.grouped(x))
        b = torch.relu(self.wide(y))
        c = torch.relu(self.reflect(x))
        d = torch.relu(self.transposed(x))
        e = torch.relu(self.same(x))
        return a, b, c, d, e

def get_inputs():
    return [torch.randn(2, 4, 8, 8), torch.randn(2, 16, 8, 8)]

def get_init_inputs():
    return []
'''


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _spec(path: Path = FIXTURE):
    return read_spec(path, name=f"fixtures/{path.stem}")


def _conv_groups(cand) -> list[dict]:
    return [g for g in cand.choices["groups"] if g["kind"] == "conv"]


def _forward_code(source: str) -> str:
    return "\n".join(line for line in source.split("def forward")[1].splitlines() if not line.strip().startswith("#"))


def test_each_small_convolution_is_one_kernel_with_its_chains():
    cand = generate(_spec(), "cpu", DIRECT)
    assert cand.choices["knobs"]["conv"] == "direct"
    groups = _conv_groups(cand)
    assert [g["ops"] for g in groups] == [
        ["conv2d", "relu", "sub", "hardswish"], ["conv2d", "tanh", "mul"], ["conv2d", "leaky_relu"],
        ["add", "conv2d", "sigmoid"], ["conv2d"], ["conv3d", "mish", "div"]]
    code = _forward_code(cand.source)
    assert "self.conv(" not in code and "conv2d(" not in code.replace("_ext.", "")
    assert not cand.choices["library"]


def test_the_library_variant_and_the_channels_last_layout_keep_the_library_convolution():
    for knobs in (Knobs(layout="nchw"), Knobs(layout="nhwc", conv="direct"), Knobs(layout="nchw", conv="direct",
                                                                                   fusion="elementwise")):
        cand = generate(_spec(), "cpu", knobs)
        assert not _conv_groups(cand) and cand.choices["knobs"]["conv"] == "library"
        assert cand.choices["knobs"]["conv_tile"] == DEFAULT_TILE      # unused: normalised


def test_cuda_direct_convolutions_are_on_unless_switched_off(monkeypatch):
    """The CUDA kernels were judged on a GPU (scripts/gpu_conv_check.py): on unless KERNELLOOP_CUDA_CONV=0."""
    monkeypatch.setenv(CUDA_CONV_ENV, "0")
    assert not _conv_groups(generate(_spec(), "cuda", DIRECT))
    monkeypatch.delenv(CUDA_CONV_ENV, raising=False)
    for tile in [*TILES, *SLIDE_TILES]:
        cuda = generate(_spec(), "cuda", Knobs(layout="nchw", conv="direct", conv_tile=tile))
        groups = _conv_groups(cuda)
        # on cuda the bias is split off the convolution (trace.py) and fused as an add
        assert [g["ops"][:2] for g in groups][:2] == [["conv2d", "add"], ["conv2d", "tanh"]] and len(groups) == 6
        assert cuda.choices["knobs"]["conv_tile"] == tile
        assert cuda.source.count("_kernel<int><<<grid") == 6
        compile(cuda.source, "cuda_candidate.py", "exec")


def test_the_register_blocked_tiles_take_unit_stride_convolutions_and_copy_raw_inputs_asynchronously():
    """``c8x8``/``c4x8`` (conv.SLIDE_TILES) need stride and dilation 1 along x: the fixture's strided and
    dilated convolutions fall back to the FMA tile, the other four are register-blocked, persistent
    blocks; the three whose input is read as it is (no prologue, float32) copy each next tile in with
    cp.async, the one behind ``x + 1.0`` stages its input through the prologue."""
    from agent.builtin.conv import FALLBACK_TILE, rendered_tile

    for tile in SLIDE_TILES:
        cuda = generate(_spec(), "cuda", Knobs(layout="nchw", conv="direct", conv_tile=tile))
        src = cuda.source
        assert src.count("// a register-blocked tile") == 4
        assert src.count("cp.async.ca.shared.global") == 3 and src.count("_wait<1>();") == 3
        assert src.count("__CUDA_ARCH__ >= 800") == 3 * 3       # a plain copy before sm_80
        assert src.count("the prologue applied as each tile's input is staged") == 1
        assert src.count("persistent blocks: as many as the SMs hold at once") == 4
        assert src.count("_kernel<int><<<grid") == 6
    strided = {"stride3": (1, 1, 2), "dilation3": (1, 1, 1), "kernel3": (1, 3, 3), "in_channels": 3,
               "out_channels": 6, "k": 27, "padding3": (0, 1, 1)}
    assert rendered_tile(strided, "c8x8") == FALLBACK_TILE
    assert rendered_tile({**strided, "stride3": (1, 2, 1)}, "c8x8") == "c8x8"     # rows may stride
    assert rendered_tile({**strided, "stride3": (1, 1, 1), "dilation3": (1, 1, 2)}, "c4x8") == FALLBACK_TILE


def test_the_tensor_core_tile_renders_3xtf32_mma_and_is_tried_only_when_switched_on(monkeypatch):
    """``conv_tile=3xtf32`` (conv.MMA_TILE): the same six convolutions and chains, each an implicit
    GEMM on TF32 mma.sync in three products (the operands split into TF32 value and remainder as
    they are staged), at most two blocks per SM. Not run on a GPU yet: the search tries it only
    with KERNELLOOP_CUDA_CONV_3XTF32=1 (``conv.tile_names``)."""
    from agent.builtin.conv import MMA_ENV, tile_names, tile_shape

    cuda = generate(_spec(), "cuda", Knobs(layout="nchw", conv="direct", conv_tile=MMA_TILE))
    groups = _conv_groups(cuda)
    assert [g["ops"][:2] for g in groups][:2] == [["conv2d", "add"], ["conv2d", "tanh"]] and len(groups) == 6
    assert cuda.choices["knobs"]["conv_tile"] == MMA_TILE
    assert cuda.source.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 6
    assert cuda.source.count("__launch_bounds__(256, 2)") == 6 and cuda.source.count("_kernel<int><<<grid") == 6
    assert "fmaf(" not in cuda.source.split("kl_g0 begin")[1].split("kl_g0 end")[0]     # no FMA loop in it
    compile(cuda.source, "cuda_candidate.py", "exec")
    # n-tiles of 8 channels, weights' rows padded by 8 (B fragments without bank conflicts), at most 64 a block
    assert tile_shape(MMA_TILE, 64)["nt"] == 8 and tile_shape(MMA_TILE, 64)["ws"] == 72
    assert tile_shape(MMA_TILE, 12)["cob"] == 16 and tile_shape(MMA_TILE, 200)["cob"] == 64
    # a convolution whose doubled staging would not fit gets the FMA tile
    from agent.builtin.conv import FALLBACK_TILE, MAX_SHARED_BYTES, rendered_tile, shared_floats

    big = {"out_channels": 64, "in_channels": 14, "k": 126, "kernel3": (1, 3, 3), "stride3": (1, 2, 2),
           "dilation3": (1, 1, 1)}
    assert sum(shared_floats(big, FALLBACK_TILE)) * 4 <= MAX_SHARED_BYTES < sum(shared_floats(big, MMA_TILE)) * 4
    # (the FMA tile, which takes its stride: not the default, a register-blocked tile that would not)
    assert rendered_tile(big, MMA_TILE) == FALLBACK_TILE != DEFAULT_TILE
    assert rendered_tile({**big, "stride3": (1, 1, 1)}, MMA_TILE) == MMA_TILE       # 112 KB: it fits
    assert rendered_tile(big, "4x16") == "4x16"
    monkeypatch.delenv(MMA_ENV, raising=False)
    assert MMA_TILE not in tile_names()
    monkeypatch.setenv(MMA_ENV, "1")
    assert tile_names() == [*TILES, *SLIDE_TILES, MMA_TILE]


def test_unsupported_convolutions_stay_the_librarys(tmp_path):
    """groups>1, K = C_in * kh * kw above the threshold, reflect padding, transposed and padding='same'."""
    path = tmp_path / "unsupported_conv.py"
    path.write_text(UNSUPPORTED)
    cand = generate(read_spec(path, name="fixtures/unsupported_conv"), "cpu", DIRECT)
    assert not _conv_groups(cand)
    assert sorted(cand.choices["library"]) == ["Conv2d"] * 4 + ["ConvTranspose2d"]


def test_the_proposer_offers_the_direct_convolution_beside_the_library_one():
    """Where NCHW comes first (the CPU; cuda with TF32 convolutions), the direct twin comes second,
    before channels-last: round 0 with two samples measures it against cuDNN/oneDNN."""
    samples = [propose(_spec(), "cpu", 0, s, []).choices for s in range(3)]
    assert [(c["knobs"]["layout"], c["knobs"]["conv"]) for c in samples] == \
        [("nchw", "library"), ("nchw", "direct"), ("nhwc", "library")]
    assert len(_conv_groups_of(samples[1])) == 6


def _conv_groups_of(choices: dict) -> list[dict]:
    return [g for g in choices["groups"] if g["kind"] == "conv"]


def _judge(source: str, device: str = "cpu"):
    from builtin_candidate import judge

    return judge(_spec(), source, device)


def _candidate() -> str:
    cand = generate(with_device_sizes(_spec(), "cpu"), "cpu", DIRECT)
    assert len(_conv_groups(cand)) == 6
    return cand.source


def test_the_direct_convolutions_are_correct_in_the_cpu_sandbox():
    from sandbox.result import Status

    result = _judge(_candidate())
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and all(c.mismatched == 0 for c in checks)


def test_a_wrong_halo_is_judged_incorrect():
    """The staged rows' input range off by one (each row's first input column staged as a zero
    of the padding): wrong at the borders only, and judged incorrect, so the test above can fail."""
    from sandbox.result import Status

    source = _candidate()
    right = "I jlo = ("
    assert source.count(right) == 6
    result = _judge(source.replace(right, "I jlo = 1 + ("))
    assert result.status is Status.incorrect, (result.status, result.error_message)


def test_the_direct_convolution_matches_pytorch_elementwise():
    """Every output within float32 rounding of PyTorch's (the prologue's padding is a zero of the
    convolution's input: x + 1.0 before a padded convolution)."""
    from builtin_candidate import reference_and_candidate

    task, ref, new = reference_and_candidate(with_device_sizes(_spec(), "cpu"), _candidate())
    inputs = task.get_inputs()
    with torch.no_grad():
        want, got = ref(*inputs), new(*inputs)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_replay_checks_the_direct_convolution(monkeypatch):
    """The plan replay emulates a conv group (float64) and blames a wrong convolution plan."""
    from agent.builtin import Feedback, _Generator
    from agent.builtin import conv, replay
    from agent.builtin.trace import trace_task

    traced = trace_task(_spec(), "cpu")
    gen = _Generator(traced, "cpu", Feedback())
    rendered = gen.render(Knobs(layout="nchw", conv="direct", matmul="ieee"))
    assert sum(c.kg.kind == "conv" for c in rendered.groups) == 6
    verdict = replay.check(gen.traced, rendered, gen.infos, None)
    assert verdict.ran and not verdict.excluded, verdict.notes
    real = conv.emulate
    monkeypatch.setattr(conv, "emulate", lambda info, x, w, b: real(info, x, w, None if b is None else 2 * b))
    verdict = replay.check(gen.traced, rendered, gen.infos, None)
    assert verdict.semantic and verdict.excluded, verdict.notes


EDGES = Path(__file__).parent / "fixtures" / "builtin" / "conv_direct_edges.py"


def _evaluate_cpu(spec, source: str):
    """The CPU sandbox's judgement of ``source`` (two trials, every check on, no timing of compile)."""
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig

    return evaluate(spec, source, "cpu", EvalConfig(numerics=Numerics(), trials=2, warmup_runs=1, timed_runs=2,
                                                     time_compile=False, profile=False))


def test_the_cpu_blocking_edges_are_correct():
    """Output widths that are not whole vectors (the dropped lanes), one and two whole vectors,
    channel counts that are not whole channel blocks (the zero weights' channels never stored),
    three stride phases with dilation: judged correct in the CPU sandbox and within float32
    rounding of PyTorch."""
    from builtin_candidate import reference_and_candidate
    from sandbox.result import Status

    spec = with_device_sizes(_spec(EDGES), "cpu")
    cand = generate(spec, "cpu", DIRECT)
    assert len(_conv_groups(cand)) == 5
    result = _evaluate_cpu(spec, cand.source)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    task, ref, new = reference_and_candidate(spec, cand.source)
    inputs = task.get_inputs()
    with torch.no_grad():
        want, got = ref(*inputs), new(*inputs)
    assert [tuple(t.shape[-1:]) for t in want] == [(35,), (13,), (16,), (33,), (32,)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_direct_twin_comes_second_where_the_layout_changes_nothing():
    """conv2d_bias_scale_sigmoid_groupnorm is not rewritten to channels-last (its convolution feeds
    a group norm), yet its direct convolution is new code: round 0's second sample measures it."""
    seed = Path(__file__).resolve().parents[1] / "tasks" / "seeds" / "conv2d_bias_scale_sigmoid_groupnorm.py"
    samples = [propose(read_spec(seed), "cpu", 0, s, []).choices for s in range(2)]
    assert [c["knobs"]["conv"] for c in samples] == ["library", "direct"]
    assert len(_conv_groups_of(samples[1])) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [*SLIDE_TILES, MMA_TILE, *TILES])
def test_the_cuda_direct_convolutions_are_correct_on_a_gpu(tile):
    """The CUDA kernels (templates/cuda_conv.cu.j2), every tile (the tensor-core one first: it has not
    run on a GPU yet), judged by the sandbox on a GPU: the six convolutions of the fixture (bias or
    not, stride 2 / padding 1, dilation 2, a prologue whose f(0) is not 0, 3-D), each one kernel with
    its chains, every output checked."""
    from builtin_candidate import assert_judged_correct

    cand = generate(with_device_sizes(_spec(), "cuda"), "cuda", Knobs(layout="nchw", conv="direct", conv_tile=tile))
    assert len(_conv_groups(cand)) == 6
    result = _judge(cand.source, "cuda")
    assert_judged_correct(result)


TAIL = Path(__file__).parent / "fixtures" / "builtin" / "conv_tail.py"


def test_a_convolution_group_ends_in_its_spatial_sum_or_mean():
    """plan.tail_reduction: a sum or mean over every spatial dim of a direct convolution's (epilogue's)
    value ends its group, so the kernel accumulates it and the convolution's output is never written.
    A mean whose input is also used elsewhere, and a mean over the channels too, are not tails; nor is
    any under ``fusion=no_prologue`` (the measured alternative: the reduction its own kernel)."""
    spec = _spec(TAIL)
    cand = generate(spec, "cpu", DIRECT)
    assert [(g["kind"], g["ops"]) for g in cand.choices["groups"]] == [
        ("conv", ["conv2d", "gelu", "mean"]), ("conv", ["conv2d", "tanh", "mul", "sum"]),
        ("conv", ["conv3d", "relu", "mean"]), ("conv", ["conv2d", "sigmoid"]), ("reduce", ["mean"]),
        ("ew", ["sub"]), ("conv", ["conv2d", "relu"]), ("reduce", ["mean"])]
    split = generate(spec, "cpu", Knobs(layout="nchw", conv="direct", fusion="no_prologue"))
    assert [g["ops"][-1] for g in split.choices["groups"] if g["kind"] == "conv"] == ["gelu", "mul", "relu", "sigmoid", "relu"]
    cuda = generate(spec, "cuda", DIRECT)
    src = cuda.source
    assert src.count("never written") == 3
    # one atomic add per warp and channel (lane 0, after the warp's shuffle sum), into a zeroed output
    assert src.count("atomicAdd(out + n * 12 + co, red * tail_scale)") == 1
    assert src.count("atomicAdd(out + n * 6 + co, red)") == 1 and src.count("torch::zeros(tsh") == 3
    # the strided one takes the FMA tile; the tensor-core tile does not accumulate a tail (the FMA tile)
    mma = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", conv_tile=MMA_TILE)).source
    assert mma.count("mma.sync.aligned") == 2 and mma.count("atomicAdd(") == 3


def _tail_candidate() -> tuple:
    spec = with_device_sizes(_spec(TAIL), "cpu")
    cand = generate(spec, "cpu", DIRECT)
    return spec, cand.source


def test_the_tail_reductions_are_correct_in_the_cpu_sandbox():
    """Judged correct (every output checked) and within float32 rounding of PyTorch, the squeezed, the
    summed and the kept-dims shapes included."""
    from builtin_candidate import assert_judged_correct, reference_and_candidate

    spec, source = _tail_candidate()
    result = _evaluate_cpu(spec, source)
    assert_judged_correct(result)
    task, ref, new = reference_and_candidate(spec, source)
    inputs = task.get_inputs()
    with torch.no_grad():
        want, got = ref(*inputs), new(*inputs)
    assert [tuple(t.shape) for t in got] == [(2, 12), (2, 6), (2, 4, 1, 1, 1), (2, 4, 38, 35), (2,)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_tail_that_drops_a_row_is_judged_incorrect():
    """The partial sums of the last output row left out: judged incorrect, so the test above can fail."""
    from sandbox.result import Status

    spec, source = _tail_candidate()
    right = "for (I r = 0; r < OD * OH; ++r)"
    assert source.count(right) == 3
    result = _evaluate_cpu(spec, source.replace(right, "for (I r = 0; r < OD * OH - 1; ++r)"))
    assert result.status is Status.incorrect, (result.status, result.error_message)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["c8x8", "c4x8", "4x8"])
def test_the_cuda_tail_reductions_are_correct_on_a_gpu(tile):
    """The CUDA tail (a warp's shuffle sum, one atomic add a warp and channel) in the register-blocked
    and the FMA tiles, judged by the sandbox on a GPU: every output checked."""
    from builtin_candidate import assert_judged_correct, judge

    spec = with_device_sizes(_spec(TAIL), "cuda")
    cand = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", conv_tile=tile))
    assert cand.source.count("never written") == 3

    result = judge(spec, cand.source, "cuda")
    assert_judged_correct(result)
