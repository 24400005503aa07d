"""CUDA kernels built with 32-bit indices only where the task's tensors allow it
(``kernels.narrow_indices_on``): the 64-bit instantiations are gone from the source, each launch
refuses larger tensors with the reason; a group whose tensors pass the launches' bound keeps both;
``KERNELLOOP_CUDA_NARROW_INDEX=0`` keeps both everywhere. Where nvcc is installed, both variants'
device code compiles."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.builtin import generate
from agent.builtin.codegen import Knobs, cuda_source_of
from agent.builtin.kernels import NARROW_ENV, NARROW_MAX_ELEMENTS, STATIC_VARIANTS_ENV
from sandbox.tasks import read_spec

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
NET = FIXTURES / "graph_net.py"          # batch norms, an add + relu, a tanh: norm and elementwise groups
REFUSAL = "built with 32-bit indices for the task's sizes; these tensors need 64-bit ones"


def _block(cu: str, group: str) -> str:
    return cu.split(f"// ---- {group} begin", 1)[1].split(f"// ---- {group} end", 1)[0]


def test_the_tasks_sizes_build_32_bit_kernels_only_and_larger_tensors_are_refused():
    cand = generate(read_spec(NET, name="fixtures/graph_net"), "cuda")
    cu = cuda_source_of(cand.source)
    assert "<int><<<" in cu and "<long long><<<" not in cu
    groups = [g["name"] for g in cand.choices["groups"] if g["name"] == g.get("kernel", g["name"])]
    assert groups and all(f'"{g}: {REFUSAL}"' in cu for g in groups), groups


def test_a_group_past_the_launch_bound_keeps_its_64_bit_kernels(monkeypatch):
    # 2**20 x 16 channels x 8 x 8 = 2**30 elements: one more than the launches' 32-bit bound
    assert 2**30 > NARROW_MAX_ELEMENTS
    big = generate(read_spec(NET, {"batch_size": 2**20}, name="fixtures/graph_net_big"), "cuda")
    cu = cuda_source_of(big.source)
    by_ops = {tuple(g["ops"]): g["name"] for g in big.choices["groups"]}
    norm = _block(cu, "kl_g0")                                  # the first batch norm
    head = _block(cu, by_ops[("tanh", "mul")])                  # tanh * 0.5 of [batch, 10]
    assert "<long long><<<" in norm and REFUSAL not in norm
    assert "<long long><<<" not in head and REFUSAL in head
    monkeypatch.setenv(NARROW_ENV, "0")
    wide = cuda_source_of(generate(read_spec(NET, name="fixtures/graph_net"), "cuda").source)
    assert "<long long><<<" in wide and REFUSAL not in wide


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (CUDA_HOME/bin/nvcc)")
@pytest.mark.parametrize("knobs", [Knobs(), Knobs(vec=False, reduce="twopass")], ids=["default", "scalar_twopass"])
@pytest.mark.parametrize("narrow", ["1", "0"])
def test_both_variants_device_code_compiles(tmp_path, monkeypatch, narrow, knobs):
    """The kernels' file includes only cuda_runtime.h: nvcc compiles it without torch's headers."""
    monkeypatch.setenv(NARROW_ENV, narrow)
    cu = tmp_path / "kernels.cu"
    cu.write_text(cuda_source_of(generate(read_spec(NET, name="fixtures/graph_net"), "cuda", knobs).source))
    done = subprocess.run([_nvcc(), "-O1", "-arch=sm_90a", "-std=c++17", "-c", str(cu), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


REACH = FIXTURES / "reach_mix.py"       # a LayerNorm over 64, a sum over rows of 4096, a mean over a middle dim
LEFT_OUT = "built for the task's sizes; these tensors need its {} kernel, which was not compiled"


def test_norms_and_reductions_compile_only_the_kernels_their_sizes_pick(monkeypatch):
    """``KernelGroup.reach``: the launch's choice, read at the task's sizes, decides which kernels
    are compiled; the launch refuses with the reason where another would be needed; the split
    kernels (long rows, few outputs) are left out only below the lengths that could pick them."""
    cand = generate(read_spec(REACH, name="fixtures/reach_mix"), "cuda")
    assert [g["kind"] for g in cand.choices["groups"]] == ["norm", "reduce", "reduce"]
    cu = cuda_source_of(cand.source)
    kernels = re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", cu)
    assert kernels == ["kl_g0_warp", "kl_g1_block", "kl_g2_col"], kernels
    norm, row_sum, col_mean = _block(cu, "kl_g0"), _block(cu, "kl_g1"), _block(cu, "kl_g2")
    assert LEFT_OUT.format("block-per-row") in norm and "_part<" not in norm
    assert LEFT_OUT.format("warp-per-row") in row_sum and LEFT_OUT.format("column") in row_sum
    assert LEFT_OUT.format("warp-per-row") in col_mean and LEFT_OUT.format("block-per-row") in col_mean
    monkeypatch.setenv(STATIC_VARIANTS_ENV, "0")
    every = cuda_source_of(generate(read_spec(REACH, name="fixtures/reach_mix"), "cuda").source)
    every_kernels = re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", every)
    assert {"kl_g0_block", "kl_g0_warp", "kl_g1_warp", "kl_g1_col", "kl_g2_block"} <= set(every_kernels)
    assert "which was not compiled" not in every


def test_long_rows_keep_the_split_kernels_the_gpu_may_pick():
    """Rows of 16384 or more may go to the split statistics where the rows are fewer than the SMs
    (read from the GPU at launch): they stay compiled, beside the block per row."""
    cand = generate(read_spec(FIXTURES / "norm_split.py", name="fixtures/norm_split"), "cuda")
    cu = cuda_source_of(cand.source)
    assert "_part<int><<<" in cu and "_block<int><<<" in cu and "warp-per-row kernel, which was not compiled" in cu


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (CUDA_HOME/bin/nvcc)")
@pytest.mark.parametrize("static", ["1", "0"])
def test_static_variants_device_code_compiles(tmp_path, monkeypatch, static):
    monkeypatch.setenv(STATIC_VARIANTS_ENV, static)
    cu = tmp_path / "kernels.cu"
    cu.write_text(cuda_source_of(generate(read_spec(REACH, name="fixtures/reach_mix"), "cuda").source))
    done = subprocess.run([_nvcc(), "-O1", "-arch=sm_90a", "-std=c++17", "-c", str(cu), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
