"""Short norm rows on CUDA (``templates/cuda_norm.cu.j2``, ``kl_row_lanes``): the warp-per-row kernel
gave a row of 64 elements 16 lanes with one vector each and half the warp nothing, and ran level2/34's
layer norm over W (4.2M rows of 64) at a quarter of the H200's bandwidth (2.2 ms, where inductor's
kernel took 0.57). A short row now takes about four items a lane, several rows a warp, the last warp's
spare lanes repeating the last row so that every lane takes part in the shuffles."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate
from sandbox.tasks import read_spec, with_device_sizes

FIXTURE = Path(__file__).parent / "fixtures" / "builtin" / "norm_short_rows.py"


def _spec():
    return read_spec(FIXTURE, name="fixtures/norm_short_rows")


def test_row_lanes_give_about_four_items_a_lane(tmp_path):
    """``kl_row_lanes`` as the candidate's source has it (common.h.j2), compiled by the host's C++
    compiler and run: a power of two from 1 to 32, about four items (vectors or elements) a lane."""
    import re
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler (every CPU build of the tests needs one)"
    src = generate(_spec(), "cuda", Knobs(graph="off")).source
    fn = re.search(r"KL_HD inline int kl_row_lanes\(long long n\) \{.*?\n\}", src, re.S)
    assert fn is not None
    ns = (1, 3, 4, 5, 16, 17, 64, 128, 129, 256, 1024)
    prog = tmp_path / "lanes.cpp"
    prog.write_text("#include <cstdio>\n#define KL_HD\n" + fn.group(0) + "\nint main() {\n"
                    + "".join(f'  std::printf("%d\\n", kl_row_lanes({n}));\n' for n in ns) + "}\n")
    subprocess.run([cxx, "-O1", "-o", str(tmp_path / "lanes"), str(prog)], check=True)
    out = subprocess.run([str(tmp_path / "lanes")], check=True, capture_output=True, text=True).stdout
    assert [int(v) for v in out.split()] == [1, 1, 1, 2, 4, 8, 16, 32, 32, 32, 32]


def test_the_warp_kernel_and_its_launch_agree_on_the_lanes_a_row():
    cand = generate(_spec(), "cuda", Knobs(graph="off"))
    assert len([g for g in cand.choices["groups"] if g["kind"] == "norm"]) == 6
    src = cand.source
    # each of the six kernels: the lanes from the row's items on both sides, the shuffles over them,
    # and the cache only where a row has a warp of its own
    assert src.count("tpr = kl_row_lanes(vec4 ? L >> 2 : L)") == 6
    assert src.count("const int tpr = kl_row_lanes(v4 ? L / 4 : L);") == 6
    assert src.count("kl_warp_welford_group(wm, wm2, wn, tpr);") == 6
    assert src.count("const int cache = tpr == 32 ? 1 : 0;") == 6
    assert "if (update && sub == 0 && live) {" in src       # the batch norm's running buffers: once a row


def test_a_layer_norms_operand_constant_along_its_rows_is_read_at_the_rows_start():
    """level2/3 and 34: the conv's bias (per channel) before a layer norm over W is the same for the
    whole row; on the vector path it is read at the row's first element (``ch``), one index for the
    row instead of a division per element. An operand varying along the row is read per element."""
    import re

    from agent.builtin.codegen import cuda_source_of

    src = cuda_source_of(generate(_spec(), "cuda", Knobs(graph="off")).source)
    warp = src[src.index("kl_g0_warp("):src.index("kl_g0_launch")]
    assert "const I ch = base;" in warp
    loads = set(re.findall(r"in\d\[[^\]]*\]", warp))
    assert "in1[kl_off(ch, r1p0)]" in loads                   # rowbias (5, 7, 1): constant along W
    assert "in2[kl_off(ch, r2p0)]" not in loads and "in2[kl_off(i, r2p0)]" in loads    # wbias (64,)


def test_short_rows_are_correct_in_the_cpu_sandbox():
    """The fixture itself (the CPU kernels: rows as before) against PyTorch, so the GPU test's
    reference is right."""
    from builtin_candidate import judge
    from sandbox.result import Status

    cand = generate(with_device_sizes(_spec(), "cpu"), "cpu")
    result = judge(_spec(), cand.source, "cpu")
    assert result.status is Status.correct, (result.status, result.error_message,
                                             result.build.first_error if result.build else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("reduce", ["onepass", "twopass"])
def test_short_rows_are_correct_on_a_gpu(reduce):
    from builtin_candidate import assert_judged_correct, judge

    cand = generate(with_device_sizes(_spec(), "cuda"), "cuda", Knobs(reduce=reduce, graph="off"))
    result = judge(_spec(), cand.source, "cuda")
    assert_judged_correct(result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_batch_norms_running_buffers_are_updated_once_a_row_on_a_gpu():
    """Five channels, four rows a warp: the second warp's three spare lanes groups repeat channel 4,
    which must still be updated once a forward (a second update would move it further)."""
    from builtin_candidate import reference_and_candidate

    spec = with_device_sizes(_spec(), "cuda")
    cand = generate(spec, "cuda", Knobs(graph="off"))
    task, ref, new = reference_and_candidate(spec, cand.source)
    ref, new = ref.cuda(), new.cuda()
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        inputs = [t.cuda() for t in task.get_inputs()]
        with torch.no_grad():
            ref(*inputs)
            new(*inputs)
    torch.testing.assert_close(new.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new.bn.running_var, ref.bn.running_var, rtol=1e-5, atol=1e-6)
    assert int(new.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 3
