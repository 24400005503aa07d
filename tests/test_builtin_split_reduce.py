"""Long reductions with few outputs split over blocks on cuda (``kernels.split_reduce_on``,
on by default, ``KERNELLOOP_CUDA_SPLIT_REDUCE=0`` off): a norm's statistics where rows are fewer than the SMs
(cuda_norm.cu.j2's _part/_fin) and column reductions with few outputs (cuda_reduce.cu.j2's
_colpart/_colfin). Rendered unless switched off; judged on a GPU (the GPU tests) and built by
nvcc (tests/test_cuda_builds.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.builtin import Knobs, generate
from agent.builtin.kernels import SPLIT_REDUCE_ENV
from sandbox.tasks import read_spec, with_device_sizes

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"


def _spec(name: str = "norm_split"):
    return read_spec(FIXTURES / f"{name}.py", name=f"fixtures/{name}")


def _kinds(cand) -> list[str]:
    return [g["kind"] for g in cand.choices["groups"]]


def test_the_split_norm_kernels_render_unless_switched_off_and_one_pass(monkeypatch):
    monkeypatch.setenv(SPLIT_REDUCE_ENV, "0")
    off = generate(_spec(), "cuda", Knobs(layout="nchw"))
    assert _kinds(off) == ["norm"] * 4 and "_part" not in off.source          # switched off
    monkeypatch.delenv(SPLIT_REDUCE_ENV, raising=False)
    on = generate(_spec(), "cuda", Knobs(layout="nchw"))                      # on by default
    assert on.choices["groups"] == off.choices["groups"]                      # the same groups, more kernels
    for g in on.choices["groups"]:
        name = g["name"]
        assert f"{name}_part<int><<<" in on.source and f"{name}_fin<int><<<" in on.source
        assert f"{name}_block<int><<<" in on.source                           # many rows: the block kernel still
    # the running buffers are updated once per row, by the first chunk's block
    assert "if (update && blockIdx.y == 0)" in on.source
    compile(on.source, "cuda_candidate.py", "exec")
    # two-pass statistics (reduce=twopass) keep one block per row
    assert "_part" not in generate(_spec(), "cuda", Knobs(layout="nchw", reduce="twopass")).source
    # the CPU target has its own kernels: unchanged
    assert "_part" not in generate(_spec(), "cpu").source


def test_the_split_column_reductions_render_for_sum_max_mean_and_logsumexp(monkeypatch):
    spec = _spec("reduce_split")
    monkeypatch.setenv(SPLIT_REDUCE_ENV, "0")
    off = generate(spec, "cuda")
    assert _kinds(off) == ["reduce"] * 4 and "_colpart" not in off.source
    monkeypatch.delenv(SPLIT_REDUCE_ENV, raising=False)
    on = generate(spec, "cuda")
    assert on.choices["groups"] == off.choices["groups"]
    for g in on.choices["groups"]:
        assert f"{g['name']}_colpart<int><<<" in on.source and f"{g['name']}_colfin<int><<<" in on.source
    assert on.source.count("kl_lse_merge(m, s, w[0], w[1]);") == 1               # logsumexp merges (m, s) pairs
    # two-pass logsumexp keeps the one-thread-per-output column kernel
    two = generate(spec, "cuda", Knobs(reduce="twopass"))
    assert two.source.count("_colpart<int><<<") == 3
    # the sum, max and mean (one partial per output) have the vector path, four outputs a thread;
    # the mean's bias, fixed along the reduced dim, read at each output's first element
    assert on.source.count("float acc4[4] = ") == 3 and "(inner % 4 == 0)" in on.source
    assert "[kl_off((base + 3), r" in on.source
    assert "acc4" not in generate(spec, "cuda", Knobs(vec=False)).source


@pytest.mark.parametrize("name", ["norm_split", "reduce_split", "norm_cols"])
def test_every_split_workspace_comes_from_the_pool_told_to_keep_its_memory(name):
    """Session af (H100): the best candidates with split kernels ran a median 158 us a forward beyond
    their kernels' time (the others 35): their workspace came from the stream-ordered pool at its
    default release threshold, which hands freed memory back to the driver at every synchronize. Every
    workspace is now taken through ``kl_ws_alloc``, which raises the current pool's threshold once per
    device before its first allocation."""
    import re

    source = generate(_spec(name), "cuda", Knobs(layout="nchw")).source
    allocs = re.findall(r"kl_ws_alloc\(&ws, ", source)
    assert allocs and "cudaMallocAsync((void**)&ws" not in source
    assert source.count("cudaMallocAsync(") == 1                                # the helper's own call
    helper = source[source.index("static cudaError_t kl_ws_alloc("):]
    helper = helper[:helper.index("\n}\n")]
    assert "cudaMemPoolAttrReleaseThreshold" in helper and "if (kept != dev)" in helper
    assert helper.index("cudaMemPoolSetAttribute") < helper.index("cudaMallocAsync")
    assert source.count("cudaFreeAsync(ws, st)") == len(allocs)


@pytest.mark.parametrize("name", ["norm_split", "reduce_split", "norm_cols", "norm_long_rows"])
def test_the_fixtures_are_judged_correct_on_the_cpu(name):
    """The fixtures themselves (prologues, the norms or reductions, epilogues) through the CPU sandbox."""
    from builtin_candidate import assert_judged_correct, judge

    spec = _spec(name)
    result = judge(spec, generate(spec, "cpu").source, "cpu")
    assert_judged_correct(result)


def test_batch_norm_over_few_long_columns_takes_the_split_kernels(monkeypatch):
    """A (rows, channels) BatchNorm1d: with the split compiled in, few long columns go to the column
    tiles cut into chunks of rows, _cpart/_cfin (level3/47: _cols ran one block for its 32 columns of
    204800 rows, 57% of the candidate; a batch norm of a channels-last view has the same layout);
    many columns, or the split off, keep _cols. The rows' split kernels are not compiled for it."""
    spec = _spec("norm_cols")
    on = generate(spec, "cuda")
    assert _kinds(on) == ["norm"]
    assert "if (Lc >= 16384 && tiles < sms) {" in on.source
    assert "_cols<int><<<" in on.source and "_cpart<int><<<" in on.source     # both: the launch chooses
    assert "_part<int><<<" not in on.source and "_block<int><<<" not in on.source
    monkeypatch.setenv(SPLIT_REDUCE_ENV, "0")
    off = generate(spec, "cuda")
    assert "_cpart" not in off.source and "_cols<int><<<" in off.source
    compile(on.source, "cuda_candidate.py", "exec")


def test_long_rows_take_the_split_kernels_however_many_rows_and_store_vectors():
    """Rows of 65536 or more go to the split kernels even where they outnumber the SMs (level2/21's
    group norm, 1024 rows of 258064: the block per row ran at 2.3 TB/s on an H200, the split's two
    kernels at 3.4-3.9 on level2/73's batch norm); the normalising passes store four values at once
    on the vector path, and there the per-channel operands are read at the channel's first element."""
    spec = _spec("norm_long_rows")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    assert _kinds(cand) == ["norm"] * 3
    assert "if (L >= 16384 && (rows < sms || L >= 65536)) {" in cand.source
    assert cand.source.count("*reinterpret_cast<float4*>(out + i0) = o;") >= 3 * 2   # each group's _fin and row kernels
    assert "const I ch = base + kl_div(j0, dS) * S;" in cand.source       # the group norm's four share a plane
    assert "const I ch = base + k * segstride;" in cand.source            # a batch or instance norm's segment is one
    assert "[kl_off(ch, " in cand.source
    assert "(meta[8] % 4 == 0)" in cand.source                            # the group norm's vectors need S % 4 == 0
    compile(cand.source, "cuda_candidate.py", "exec")
    scalar = generate(spec, "cuda", Knobs(layout="nchw", vec=False))
    assert "out + i0" not in scalar.source and "[kl_off(ch, " not in scalar.source


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["norm_split", "reduce_split", "norm_cols", "norm_long_rows"])
@pytest.mark.parametrize("split", ["1", "0"])   # the split first: a short box should judge it
def test_split_reductions_are_correct_on_a_gpu(monkeypatch, split, name):
    """The norms' rows (4-8, fewer than the SMs) and the column reductions (16 outputs) split into
    chunks or not, judged by the sandbox on a GPU: every output against the reference."""
    from builtin_candidate import assert_judged_correct, judge

    monkeypatch.setenv(SPLIT_REDUCE_ENV, split)
    spec = with_device_sizes(_spec(name), "cuda")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    assert ("part<int><<<" in cand.source) == (split == "1")
    # the long rows' vector path, and (split) their scalar one
    knobs = [Knobs(layout="nchw")] + ([Knobs(layout="nchw", vec=False)] if name == "norm_long_rows" and split == "1" else [])
    for k in knobs:
        result = judge(spec, generate(spec, "cuda", k).source, "cuda")
        assert_judged_correct(result, k)


@pytest.mark.gpu
def test_split_batch_norm_updates_its_running_buffers_and_reads_them_in_eval_mode(monkeypatch):
    """The sandbox compares outputs only: BatchNorm's running buffers after two training-mode
    forwards (updated once per row, by chunk 0's block) and an eval-mode forward (the running
    statistics, no partials) are compared here, in one process."""
    import torch

    from sandbox.tasks import load_task

    monkeypatch.setenv(SPLIT_REDUCE_ENV, "1")
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
