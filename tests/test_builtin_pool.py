"""Fused 2-D and 3-D pooling (agent/builtin/pool.py): conv -> elementwise -> max/avg pool -> elementwise
as one generated kernel after the convolution, in NCHW and on the channels-last view; the library's
pooling in the ``elementwise`` fusion variant and for every pooling the kernels do not reproduce;
the candidates built and judged in the CPU sandbox (right where right, NaN as PyTorch, incorrect
where a kernel is planted wrong)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate, propose, replay_verdict
from agent.builtin.pool import CUDA_POOL_ENV
from sandbox.tasks import read_spec, with_device_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
CONV_POOL = FIXTURES / "conv_pool.py"
CONV3D_POOL = FIXTURES / "conv3d_pool.py"
POOLS = ["max_pool2d", "avg_pool2d", "max_pool2d"]
POOLS_3D = ["max_pool3d", "avg_pool3d", "max_pool3d"]

UNSUPPORTED = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.ceil = nn.MaxPool2d(2, ceil_mode=True)
        self.dilated = nn.MaxPool2d(2, dilation=2)
        self.exclusive = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def forward(self, x):
        a = self.ceil(x * 2.0) + 1.0
        b = self.dilated(x * 2.0) + 1.0
        c = self.exclusive(x * 2.0) + 1.0
        d = F.avg_pool2d(x * 2.0, 2, divisor_override=3) + 1.0
        e = F.max_pool3d(x.unsqueeze(1) * 2.0, 2, ceil_mode=True) + 1.0
        return a, b, c, d, e

def get_inputs():
    return [torch.randn(2, 3, 9, 9)]

def get_init_inputs():
    return []
'''


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})


def _spec(path: Path = CONV_POOL):
    return read_spec(path, name=f"fixtures/{path.stem}")


def _forward_code(source: str) -> str:
    return "\n".join(line for line in source.split("def forward")[1].splitlines() if not line.strip().startswith("#"))


def _pool_groups(cand) -> list[dict]:
    return [g for g in cand.choices["groups"] if g["kind"] == "pool"]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_each_pool_is_one_kernel_with_its_chains(layout, monkeypatch):
    monkeypatch.setenv(CUDA_POOL_ENV, "1")
    cand = generate(_spec(), "cpu", Knobs(layout=layout))
    assert cand.choices["knobs"]["layout"] == layout
    groups = _pool_groups(cand)
    assert [[op for op in g["ops"] if op in POOLS] for g in groups] == [[p] for p in POOLS]
    assert [g["ops"] for g in groups][:2] == [["sub", "hardswish", "max_pool2d", "mish"],
                                               ["add", "tanh", "sub", "avg_pool2d", "mul", "sigmoid"]]
    assert groups[2]["ops"][-1] == "add" and "relu" in groups[2]["ops"]
    assert len(cand.choices["groups"]) == 3               # nothing else: one kernel per convolution's epilogue
    code = _forward_code(cand.source)
    assert "pool" not in code.replace("_ext.", "")        # no pooling on PyTorch
    # the CUDA candidate renders in both layouts (built on a GPU: scripts/gpu_pool_check.py)
    cuda = generate(_spec(), "cuda", Knobs(layout=layout))
    assert [[op for op in g["ops"] if op in POOLS] for g in _pool_groups(cuda)] == [[p] for p in POOLS]
    assert cuda.source.count("_kernel<int><<<") == 3
    compile(cuda.source, "cuda_candidate.py", "exec")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_nchw_pools_read_a_planes_operands_once_at_its_first_element(device, monkeypatch):
    """The convolution's bias (and the fixture's own per-channel bias) before a pool are fixed over a
    window's (n, c) plane: an NCHW pool kernel reads them once, at the plane's first element, before
    the window loop (``plane_loads``), instead of dividing every window element's index under its
    guard (level2/65's 4x4 average pool, 64-bit indices: two 64-bit divisions per element read). On
    the channels-last view a window spans rows and columns, and the operands keep their element's
    index."""
    monkeypatch.setenv(CUDA_POOL_ENV, "1")
    plane = {"cuda": "base", "cpu": "nc * H * W"}[device]

    def pools(layout: str) -> list[str]:
        cand = generate(_spec(), device, Knobs(layout=layout, graph="off"))
        src = cand.source
        return [src[src.index(f"{g['name']} begin"):src.index(f"{g['name']} end")] for g in _pool_groups(cand)]

    nchw = pools("nchw")
    assert len(nchw) == 3
    k = nchw[1]                                   # b's own bias (and, on cuda, the convolution's)
    load = k.index(f"const float pl")
    assert f"kl_off({plane}, " in k[load:k.index("\n", load)]
    window = k[k.index("acc = "):]
    assert load < k.index("acc = ") and re.search(r"\bpl\d+\b", window)       # read once, used in the window
    assert not any("kl_off(i, " in k for k in nchw)
    assert not any("const float pl" in k for k in pools("nhwc"))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_cuda_pool_kernels_take_an_outputs_position_apart_with_launch_time_divisors(layout, monkeypatch):
    """An output's (n, c, [od,] oh, ow) from its index: divisions by the sizes as ``KlDiv`` fixed at
    launch (a multiply-high and a shift for 32-bit indices; exact: test_builtin_division), not by
    ``/`` and ``%`` on runtime values (about twenty instructions each, up to six an output)."""
    monkeypatch.setenv(CUDA_POOL_ENV, "1")
    for path, divisors in ((CONV_POOL, ["dOW", "dOH"]), (CONV3D_POOL, ["dOW", "dOH", "dOD"])):
        cand = generate(_spec(path), "cuda", Knobs(layout=layout, graph="off"))
        for g in _pool_groups(cand):
            k = cand.source[cand.source.index(f"{g['name']} begin"):cand.source.index(f"{g['name']} end")]
            body = k[k.index("for (I o = "):k.index("float acc")]
            assert all(f"kl_div(t, {d})" in body for d in divisors), body
            assert ("kl_div(o, dC)" in body) == (layout == "nhwc"), body
            assert "%" not in body and " / " not in body, body
            assert "KlDiv<int>((int)meta[7])" in k          # (the fixture's sizes need no 64-bit launch)


def test_cuda_pool_kernels_are_on_unless_switched_off(monkeypatch):
    """The CUDA pool kernels were judged on a GPU (scripts/gpu_pool_check.py): a cuda candidate fuses
    its pools unless KERNELLOOP_CUDA_POOL=0, which keeps PyTorch's pooling; the CPU's are always fused."""
    monkeypatch.delenv(CUDA_POOL_ENV, raising=False)
    assert len(_pool_groups(generate(_spec(), "cuda"))) == 3
    monkeypatch.setenv(CUDA_POOL_ENV, "0")
    for layout in ("nchw", "nhwc"):
        off = generate(_spec(), "cuda", Knobs(layout=layout))
        assert off.choices["groups"] and not _pool_groups(off)
        assert len(_pool_groups(generate(_spec(), "cpu", Knobs(layout=layout)))) == 3


def test_the_elementwise_variant_keeps_the_library_pooling():
    """fusion=elementwise: the pools run as the reference calls them (on the view: pooled in
    logical order, permuted back), the chains around them as elementwise kernels."""
    for layout in ("nchw", "nhwc"):
        lib = generate(_spec(), "cpu", Knobs(fusion="elementwise", layout=layout))
        assert lib.choices["groups"] and not _pool_groups(lib)
        code = _forward_code(lib.source)
        assert ("self.pool(" in code) == (layout == "nchw")
        assert code.count("max_pool2d(") + code.count("avg_pool2d(") + code.count("self.pool(") == 3
    # split: the pool a kernel of its own; no_prologue: the chain before it a kernel of its own
    split = generate(_spec(), "cpu", Knobs(fusion="split"))
    assert [g["ops"] for g in _pool_groups(split)] == [[p] for p in POOLS]
    nopro = generate(_spec(), "cpu", Knobs(fusion="no_prologue"))
    assert [g["ops"][0] for g in _pool_groups(nopro)] == POOLS


def test_the_proposer_tries_fused_pooling_first_and_the_library_pooling_later():
    """Round 0 on the CPU: the fused candidate in NCHW, its direct-convolution twin (conv.py; its
    pools fused too), the fused candidate channels-last, then no_prologue, then the library-pooling variant
    (fusion=elementwise), so measurement can choose between them."""
    samples = [propose(_spec(), "cpu", 0, s, []).choices for s in range(5)]
    assert [(c["knobs"]["fusion"], c["knobs"]["layout"], c["knobs"]["conv"]) for c in samples] == \
        [("max", "nchw", "library"), ("max", "nchw", "direct"), ("max", "nhwc", "library"),
         ("no_prologue", "nhwc", "library"), ("elementwise", "nhwc", "library")]
    assert [sum(g["kind"] == "pool" for g in c["groups"]) for c in samples] == [3, 3, 3, 3, 0]


def test_unsupported_pooling_keeps_the_library_call(tmp_path):
    """ceil_mode (2-D and 3-D), dilation 2, count_include_pad=False and divisor_override stay the library's."""
    path = tmp_path / "unsupported_pool.py"
    path.write_text(UNSUPPORTED)
    cand = generate(read_spec(path, name="fixtures/unsupported_pool"), "cpu")
    assert not _pool_groups(cand) and {g["kind"] for g in cand.choices["groups"]} == {"ew"}
    assert cand.choices["library"].count("MaxPool2d") == 2 and "AvgPool2d" in cand.choices["library"]
    code = _forward_code(cand.source)
    for call in ("self.ceil(", "self.dilated(", "self.exclusive(", "divisor_override=3", "max_pool3d("):
        assert call in code


def test_the_replay_checks_the_pool_kernels(monkeypatch):
    verdict = replay_verdict(_spec())
    assert verdict.ran and not verdict.excluded, verdict.notes
    # plant a planning bug: average pooling dividing by the window's real elements (count_include_pad=False)
    from agent.builtin import pool

    real = pool.emulate

    def exclusive(info, x):
        if info.op != "avg_pool2d":
            return real(info, x)
        p = info.params
        return torch.nn.functional.avg_pool2d(x, p["kernel"], p["stride"], p["padding"], count_include_pad=False)

    monkeypatch.setattr(pool, "emulate", exclusive)
    import agent.builtin as builtin
    monkeypatch.setattr(builtin, "_VERDICTS", {})
    verdict = replay_verdict(_spec())
    assert len(verdict.semantic) == 1 and len(verdict.excluded) >= 1, verdict.notes


def _judge(source: str, device: str = "cpu"):
    from builtin_candidate import judge

    return judge(_spec(), source, device)


def _candidate(layout: str) -> str:
    cand = generate(with_device_sizes(_spec(), "cpu"), "cpu", Knobs(layout=layout))
    assert len(_pool_groups(cand)) == 3 and cand.choices["knobs"]["layout"] == layout
    return cand.source


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_pool_kernels_are_correct_in_the_cpu_sandbox(layout):
    from sandbox.result import Status

    result = _judge(_candidate(layout))
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and all(c.mismatched == 0 for c in checks)


def test_a_wrong_pool_kernel_is_judged_incorrect():
    """Average pooling planted to divide by the window's real elements (count_include_pad=False):
    wrong at the borders only, and judged incorrect, so the test above can fail."""
    from sandbox.result import Status

    source = _candidate("nhwc")
    right = "acc = acc / 9.f;"
    assert source.count(right) == 1
    result = _judge(source.replace(right, "acc = acc / (float)((he - hs) * (we - ws));"))
    assert result.status is Status.incorrect, (result.status, result.error_message)


def test_max_pooling_propagates_nan_as_pytorch():
    """NaN and -inf in the input: every output (max with and without padding, avg) equal to
    PyTorch's, NaN where PyTorch's is NaN, in both layouts."""
    from builtin_candidate import reference_and_candidate

    spec = with_device_sizes(_spec(), "cpu")
    for layout in ("nchw", "nhwc"):
        task, ref, new = reference_and_candidate(spec, _candidate(layout))
        (x,) = task.get_inputs()
        x[0, 0, 4, 4] = float("nan")
        x[1, 2, 0, 0] = float("nan")
        x[1, 1, 7, 9] = float("-inf")
        with torch.no_grad():
            want, got = ref(x), new(x)
        for w, g in zip(want, got):
            assert w.isnan().any() and not w.isnan().all()
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_the_pool_kernels_are_correct_in_bfloat16():
    """Under bf16 the pool kernels load and store c10::BFloat16, pool and accumulate in float
    (the channels-last candidate, judged by the sandbox at bf16's tolerance)."""
    from builtin_candidate import judge
    from sandbox.numerics import Numerics
    from sandbox.result import Status

    numerics = Numerics(precision="bf16")
    cand = generate(with_device_sizes(_spec(), "cpu"), "cpu", Knobs(layout="nhwc"), numerics=numerics)
    assert len(_pool_groups(cand)) == 3 and "const c10::BFloat16* __restrict__ in0" in cand.source
    result = judge(_spec(), cand.source, "cpu", numerics)
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_each_3d_pool_is_one_kernel_with_its_chains(layout):
    """3-D pools (level2/6, 72, 78, 89 ... pool a 3-D convolution's output) fuse as the 2-D ones do."""
    for device in ("cpu", "cuda"):
        cand = generate(_spec(CONV3D_POOL), device, Knobs(layout=layout))
        groups = _pool_groups(cand)
        assert [[op for op in g["ops"] if op in POOLS_3D] for g in groups] == [[p] for p in POOLS_3D]
        assert groups[0]["ops"][-4:] == ["sub", "hardswish", "max_pool3d", "mish"]
        assert len(cand.choices["groups"]) == 3
        assert "pool" not in _forward_code(cand.source).replace("_ext.", "")
        compile(cand.source, "candidate.py", "exec")


def _candidate_3d(layout: str, device: str = "cpu") -> str:
    cand = generate(with_device_sizes(_spec(CONV3D_POOL), device), device, Knobs(layout=layout))
    assert len(_pool_groups(cand)) == 3 and cand.choices["knobs"]["layout"] == layout
    return cand.source


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_3d_pool_kernels_are_correct_in_the_cpu_sandbox(layout):
    from builtin_candidate import judge
    from sandbox.result import Status

    result = judge(_spec(CONV3D_POOL), _candidate_3d(layout), "cpu")
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)
    checks = [o for t in result.trials for o in t.outputs]
    assert checks and all(c.mismatched == 0 for c in checks)


def test_a_3d_pool_reading_the_wrong_depth_is_judged_incorrect():
    """The 3-D average pool planted to skip the window's first depth plane: judged incorrect, so the
    test above can fail on the depth loop."""
    from builtin_candidate import judge
    from sandbox.result import Status

    source = _candidate_3d("nchw")
    right = "for (I id = ds; id < de; ++id) {"
    assert source.count(right) == 3
    i = source.index(right, source.index(right) + 1)           # the second pool: the average
    planted = source[:i] + "for (I id = ds + 1; id < de; ++id) {" + source[i + len(right):]
    result = judge(_spec(CONV3D_POOL), planted, "cpu")
    assert result.status is Status.incorrect, (result.status, result.error_message)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_cuda_pool_kernels_are_correct_on_a_gpu(layout):
    """The CUDA pooling kernels (templates/cuda_pool.cu.j2) in both layouts, judged by the sandbox on
    a GPU: the fixture's three pools, each one kernel with its chains, every output checked."""
    from builtin_candidate import assert_judged_correct

    cand = generate(with_device_sizes(_spec(), "cuda"), "cuda", Knobs(layout=layout))
    assert len(_pool_groups(cand)) == 3
    result = _judge(cand.source, "cuda")
    assert_judged_correct(result)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_cuda_3d_pool_kernels_are_correct_on_a_gpu(layout):
    """Judged under ``fp32/strict`` (IEEE fp32 convolutions in both the reference and the candidate),
    so the check is of the pool kernels: under the default numerics cuDNN may run the candidate's
    channels-last 3-D convolution in TF32 where the reference's NCDHW one is IEEE (which layout is
    acceptable is the judge's call on each task, not this test's)."""
    from builtin_candidate import assert_judged_correct, judge
    from sandbox.numerics import Numerics

    result = judge(_spec(CONV3D_POOL), _candidate_3d(layout, "cuda"), "cuda", Numerics(math="strict"))
    assert_judged_correct(result, [o.max_abs_err for t in result.trials for o in t.outputs])
