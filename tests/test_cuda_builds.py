"""CUDA candidates really compile with nvcc, on a machine without a GPU.

Marked ``nvcc``: runs where nvcc and a CUDA build of torch are installed (``scripts/nvcc_check.sh``
installs one aside and runs this file), skipped elsewhere (CI's CPU torch). Every build goes
through the sandbox's own build stage, in a worker with the GPU hidden, exactly as on a GPU host;
so these tests also prove the sandbox hands its workers the architecture to build for.

What is built: the builtin proposer's CUDA candidates for every task of tasks/seeds and
tasks/level2 (two knob settings that take different template paths, the second with 64-bit indices too), the CUDA fixtures of the
critic (one must fail at the line the manifest names), and the honest and compile-error
candidates of the adversarial suite.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.evaluate import Sandbox
from sandbox.result import EvalConfig, Status
from sandbox.tasks import discover, read_spec

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parent.parent
ARCH = "9.0a"                 # Hopper with its arch-specific target, as the sandbox picks on an H100/H200
TASKS = discover(["seeds", "level2"])
CRITIC = ROOT / "tests" / "fixtures" / "critic"
MANIFEST = json.loads((CRITIC / "manifest.json").read_text())["fixtures"]
CRITIC_CUDA = [fx for fx in MANIFEST if fx.get("cuda")]
ADVERSARIAL = ROOT / "tests" / "adversarial"
SMALL_TASK = read_spec(ADVERSARIAL / "task_small.py", name="adversarial/task_small")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox("cuda", EvalConfig(build_timeout_s=1200.0), build_slots=1, arch=ARCH) as sb:
        yield sb


@pytest.mark.parametrize("knobs", ["default", "scalar_twopass_128"])
@pytest.mark.parametrize("path", TASKS, ids=[f"{p.parent.name}/{p.stem}" for p in TASKS])
def test_builtin_candidate_builds(sandbox, path, knobs, monkeypatch):
    from agent.builtin import generate
    from agent.builtin.codegen import Knobs
    from agent.builtin.kernels import NARROW_ENV

    if knobs != "default":
        monkeypatch.setenv(NARROW_ENV, "0")     # the 64-bit instantiations too (kernels.narrow_indices_on)
    spec = read_spec(path)
    k = Knobs() if knobs == "default" else Knobs(vec=False, reduce="twopass", block=128)
    cand = generate(spec, "cuda", k)
    check = sandbox.build_only(spec, cand.source)
    detail = f"{spec.name} {k}: {check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"
    assert check.ok, detail
    assert check.arch == ARCH and check.build is not None and check.build.extensions, detail
    if cand.covered_ops:
        # the candidate's own kernels were compiled into the extension: nvcc really ran
        assert "__global__" in cand.source, detail


BUILTIN_FIXTURES = ROOT / "tests" / "fixtures" / "builtin"


@pytest.mark.parametrize("variant", ["conv:4x16", "conv:2x16", "conv:4x8", "conv:8x8", "conv:c8x8", "conv:c4x8", "conv:3xtf32",
                                     "tail:c8x8", "tail:4x8", "tail:3xtf32", "stats:c8x8", "stats:4x8", "pool:nchw", "pool:nhwc"])
def test_builtin_conv_and_pool_kernels_build(sandbox, variant):
    """The direct convolution in every CUDA tile (conv_direct.py: stride, dilation, 3-D, a prologue),
    the tensor-core one (3xTF32 mma.sync) included, its tail reductions (conv_tail.py: the tensor-core
    tile falls back to the FMA one there), the batch norms' statistics summed by the convolutions
    (conv_bn.py, conv_stats.py) and the fused pools in both layouts (conv_pool.py):
    templates cuda_conv / cuda_norm / cuda_pool compile."""
    from agent.builtin import generate
    from agent.builtin.codegen import Knobs
    from agent.builtin.conv import MMA_TILE, SLIDE_TILES, TILES

    kind, value = variant.split(":")
    if kind in ("conv", "tail", "stats"):
        assert value in [*TILES, *SLIDE_TILES, MMA_TILE]
        name = {"conv": "conv_direct", "tail": "conv_tail", "stats": "conv_bn"}[kind]
        spec = read_spec(BUILTIN_FIXTURES / f"{name}.py", name=f"fixtures/{name}")
        cand = generate(spec, "cuda", Knobs(layout="nchw", conv="direct", conv_tile=value))
        if kind == "tail":
            assert [g["ops"][-1] for g in cand.choices["groups"] if g["kind"] == "conv"][:3] == ["mean", "sum", "mean"]
        if kind == "stats":
            assert cand.source.count("_kl_stats_kl_g") == 6
        kind = "conv"
    else:
        spec = read_spec(BUILTIN_FIXTURES / "conv_pool.py", name="fixtures/conv_pool")
        cand = generate(spec, "cuda", Knobs(layout=value))
    assert any(g["kind"] == kind for g in cand.choices["groups"]), cand.choices["groups"]
    check = sandbox.build_only(spec, cand.source)
    assert check.ok, f"{variant}: {check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"


@pytest.mark.parametrize("name,kernels", [("norm_split", 4), ("reduce_split", 4), ("norm_long_rows", 3)])
def test_builtin_split_reduction_kernels_build(sandbox, monkeypatch, name, kernels):
    """Long reductions with few outputs split over blocks (KERNELLOOP_CUDA_SPLIT_REDUCE=1): the norms
    of norm_split.py (cuda_norm.cu.j2's _part/_fin: BatchNorm with running buffers, GroupNorm,
    LayerNorm, InstanceNorm) and norm_long_rows.py (long rows, per-channel operands), and the
    column reductions of reduce_split.py (cuda_reduce.cu.j2's _colpart/_colfin: sum, max, logsumexp,
    mean, the vector path of four outputs a thread)."""
    from agent.builtin import generate
    from agent.builtin.codegen import Knobs
    from agent.builtin.kernels import SPLIT_REDUCE_ENV

    monkeypatch.setenv(SPLIT_REDUCE_ENV, "1")
    spec = read_spec(BUILTIN_FIXTURES / f"{name}.py", name=f"fixtures/{name}")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    assert cand.source.count("fin<int><<<") == kernels
    check = sandbox.build_only(spec, cand.source)
    assert check.ok, f"{check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"


@pytest.mark.parametrize("fx", CRITIC_CUDA, ids=[fx["name"] for fx in CRITIC_CUDA])
def test_critic_cuda_fixture_builds_as_the_manifest_says(sandbox, fx):
    spec = read_spec(ROOT / fx["task"])
    source = (CRITIC / fx["cuda"]).read_text()
    check = sandbox.build_only(spec, source)
    expect = {**fx["expect"], **fx.get("expect_cuda", {})}
    if expect.get("status") == "compile_error":
        assert not check.ok and check.status is Status.compile_error, check
        line = check.build.first_error_line
        assert line is not None, check.build.log[-3000:]
        wanted = expect.get("error_line_text")
        if wanted:
            assert wanted in source.splitlines()[line - 1], (line, source.splitlines()[line - 1])
    else:
        assert check.ok, f"{fx['name']}: {check.error_message}\n{check.build.log[-3000:] if check.build else ''}"


@pytest.mark.parametrize("name", ["honest", "compile_error"])
def test_adversarial_cuda_builds(sandbox, name):
    spec = SMALL_TASK
    check = sandbox.build_only(spec, (ADVERSARIAL / "cuda" / f"{name}.py").read_text())
    if name == "compile_error":
        assert check.status is Status.compile_error and check.build.first_error, check
    else:
        assert check.ok, check


def test_identical_candidate_is_a_cache_hit(sandbox):
    spec = SMALL_TASK
    source = (ADVERSARIAL / "cuda" / "honest.py").read_text()
    first = sandbox.build_only(spec, source)
    again = sandbox.build_only(spec, source)
    assert first.ok and again.ok and again.build.cached
    assert again.build.extensions == first.build.extensions


def test_prompt_worked_example_builds(sandbox):
    # The CUDA example every first-round prompt shows the model must itself compile.
    from agent.parse import parse_answer
    from agent.prompts import build_proposal_messages
    from agent.types import DeviceFacts

    spec = SMALL_TASK
    gpu = DeviceFacts(device="cuda", name="NVIDIA H200", torch_version="2.13.0", compute_capability="9.0")
    _, messages, _ = build_proposal_messages(spec, gpu, 0, [], None, None)
    parsed = parse_answer(messages[1]["content"], "stop")
    assert parsed.status == "ok" and "__global__" in parsed.source
    check = sandbox.build_only(spec, parsed.source)
    assert check.ok, check


KERNELBENCH_STYLE = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void relu_kernel(const float* x, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;   // SALT
}
torch::Tensor relu_cuda(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  auto y = torch::empty_like(x);
  long n = x.numel();
  relu_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  EXTRA
  return y;
}
"""
ext = load_inline(name="kb_relu", cpp_sources=["torch::Tensor relu_cuda(torch::Tensor x);"], cuda_sources=[CUDA],
                  functions=["relu_cuda"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return ext.relu_cuda(self.linear(x))
'''


@pytest.mark.parametrize("extra, whole, split", [
    # tensors, factories, TORCH_CHECK: minimal headers; split, the kernels apart from the wrapper
    ("", ["{minimal}"], ["{split}"]),
    # an op the minimal headers lack: torch/types.h; split, the wrappers' C++ file on torch/extension.h
    ("y = torch::matmul(y, y.t());", ["not {minimal}: tried {types}", "{types}"],
     ["not {split}: tried {split_full}", "{split_full}"]),
    ("y = torch::nn::functional::relu(y);", ["not {minimal}: tried {types}", "not {types}: tried {own}"],
     ["not {split}: tried {split_full}", "{split_full}"]),
    # a real error: straight to its own headers, which decide the verdict
    ("y = y + undeclared_name;", ["not {minimal}: tried {own}"],
     ["not {split}: tried {minimal}", "not {minimal}: tried {own}"]),
])
def test_kernelbench_style_source_builds_with_the_lightest_headers_that_work(sandbox, extra, whole, split):
    """Run with KERNELLOOP_CUDA_SPLIT=0 too (nvcc_check.sh does): the split tries come first unless it is off."""
    import uuid

    from sandbox.build import PREFIX_NOTE
    from sandbox.header_tries import (MINIMAL_NOTE, OWN_NOTE, SPLIT_FULL_NOTE, SPLIT_NOTE, TYPES_NOTE,
                                      split_enabled)
    from sandbox.pyglue import RAW_NOTE

    words = {"split": SPLIT_NOTE, "split_full": SPLIT_FULL_NOTE, "minimal": MINIMAL_NOTE, "types": TYPES_NOTE,
             "own": OWN_NOTE}
    want = [e.format(**words) for e in (split if split_enabled() else whole)]
    spec = SMALL_TASK
    source = KERNELBENCH_STYLE.replace("EXTRA", extra).replace("SALT", uuid.uuid4().hex)
    check = sandbox.build_only(spec, source)
    # the tries' own notes (the binding and precompiled-header notes beside them are other tests')
    assert [n for n in check.build.notes if n not in (PREFIX_NOTE, RAW_NOTE)] == want, check.build.notes
    if "undeclared_name" in extra:
        assert check.status is Status.compile_error and "undeclared_name" in check.build.first_error, check
        line = check.build.first_error_line
        assert line is not None and "undeclared_name" in source.splitlines()[line - 1]
    else:
        assert check.ok, check


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_attention_builds(sandbox, precision):
    """The attention kernel (cuda_attn.cu.j2: causal softmax, ReLU and a non-causal mask in one
    extension, every head-dim instantiation) compiles with nvcc, in float32 and in bfloat16."""
    from agent.builtin import generate
    from sandbox.numerics import Numerics

    spec = read_spec(ROOT / "tests" / "fixtures" / "builtin" / "attention_pair.py", name="fixtures/attention_pair")
    cand = generate(spec, "cuda", numerics=Numerics(precision=precision))
    assert [g["kind"] for g in cand.choices["groups"]] == ["attention"] * 3
    assert "KL_ATTN_LAUNCH(128)" in cand.source and "kl_g1_causal_check<<<" in cand.source
    check = sandbox.build_only(spec, cand.source)
    detail = f"{precision}: {check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"
    assert check.ok and check.build is not None and check.build.extensions, detail


def test_unrolled_elman_loop_builds(sandbox):
    """level3/34's shape of loop (``agent/builtin/unrolled_rnn.py``) at 20 steps: the tanh RNN
    layer's cooperative kernel and host code, called with the loop's split weights."""
    from agent.builtin import generate

    spec = read_spec(BUILTIN_FIXTURES / "rnn_loop.py", {"sequence_length": 20}, name="fixtures/rnn_loop_20")
    cand = generate(spec, "cuda")
    assert [g["kind"] for g in cand.choices["groups"]] == ["recurrent"]
    check = sandbox.build_only(spec, cand.source)
    assert check.ok, f"{check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"


def test_masked_fill_chain_builds(sandbox):
    """The bool-masked selection (``sub -> masked_fill -> exp`` of Mamba2's segment sum, the mask
    converted to float32 on the host side) compiles: the fixture of tests/fixtures/builtin/segsum.py."""
    from agent.builtin import generate

    spec = read_spec(BUILTIN_FIXTURES / "segsum.py", name="fixtures/segsum")
    cand = generate(spec, "cuda")
    assert "masked_fill" in cand.covered_ops and ".to(torch.float32))" in cand.source     # the bool mask as 0/1
    check = sandbox.build_only(spec, cand.source)
    assert check.ok, f"{check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"


@pytest.mark.kernelbench
@pytest.mark.parametrize("task", ["29_SwinMLP", "48_Mamba2ReturnY", "49_Mamba2ReturnFinalState"])
def test_meta_traced_level3_networks_build(sandbox, task):
    """The level-3 networks only the meta tracer traces (trace._MetaShapeTracer) build as whole
    candidates, host glue and kernels, at KernelBench's sizes."""
    from agent.builtin import generate
    from evals.kernelbench import kernelbench_root

    if task.startswith("48_") or task.startswith("49_"):
        pytest.importorskip("einops")
    spec = read_spec(kernelbench_root() / "level3" / f"{task}.py", name=f"level3/{task}")
    cand = generate(spec, "cuda")
    assert cand.covered_ops, cand.choices
    check = sandbox.build_only(spec, cand.source)
    assert check.ok, f"{task}: {check.status} {check.error_message}\n{(check.build.log if check.build else '')[-3000:]}"
