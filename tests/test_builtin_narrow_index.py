"""CUDA kernels built with 32-bit indices only where the task's tensors allow it
(``kernels.narrow_indices_on``): the 64-bit instantiations are gone from the source, each launch
refuses larger tensors with the reason; a group whose tensors pass the launches' bound keeps both;
``KERNELLOOP_CUDA_NARROW_INDEX=0`` keeps both everywhere. Where nvcc is installed, both variants'
device code compiles."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.builtin import generate
from agent.builtin.codegen import Knobs, cuda_source_of
from agent.builtin.kernels import NARROW_ENV, NARROW_MAX_ELEMENTS
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
    norm, head = _block(cu, "kl_g0"), _block(cu, "kl_g4")     # the first batch norm; tanh * 0.5 of [batch, 10]
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
