"""The KernelBench-style CUDA source split (sandbox/cuda_split.py): kernels apart from their torch
wrappers, each launch a call of a stub with the kernel's own parameters; sources whose shape the
split cannot be sure of are left whole. The builds are in tests/test_cuda_builds.py (nvcc, no GPU);
the last test here judges a split candidate on a GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandbox.cuda_split import STUB_PREFIX, items, split_cuda
from sandbox.header_tries import MINIMAL_NOTE, SPLIT_FULL_NOTE, SPLIT_NOTE, header_tries

from remeasure import remeasured

KB = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_fp16.h>
#define CHECK(x) TORCH_CHECK(x.is_cuda(), #x " must be CUDA")
struct Params { int n; float scale; };   // a parameter type both sides need
constexpr int BLOCK = 256;
/* a device helper */
__device__ __forceinline__ float act(float v) { return v > 0.f ? v : 0.01f * v; }
__global__ void __launch_bounds__(256) fused_kernel(const float* __restrict__ x, float* __restrict__ y, Params p) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) { y[i] = act(x[i]) * p.scale; }   // "}" in a comment; '{' too
}
static int ceil_div(int a, int b) { return (a + b - 1) / b; }
torch::Tensor fused_cuda(torch::Tensor x, double scale) {
  CHECK(x);
  auto y = torch::empty_like(x);
  Params p{(int)x.numel(), (float)scale};
  fused_kernel<<<ceil_div(p.n, BLOCK), BLOCK, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), y.data_ptr<float>(), p);
  const char* braces = "{ ; }";
  (void)braces;
  return y;
}
'''


def test_a_kernelbench_source_splits_into_kernels_and_wrappers():
    sp = split_cuda(KB)
    assert sp is not None and sp.kernels == ("fused_kernel",)
    # the kernels' file: no torch, the kernel and its helper as written, a stub that launches it
    assert "torch" not in sp.device and "TORCH_CHECK" not in sp.device.replace("#define CHECK(x) TORCH_CHECK", "")
    assert "__launch_bounds__(256) fused_kernel(" in sp.device and "act(float v)" in sp.device
    assert "#include <cuda_fp16.h>" in sp.device and "struct Params" in sp.device
    stub = re.search(rf"void {STUB_PREFIX}fused_kernel\((.*?)\) {{\n\s*(.*?)\n}}", sp.device, re.DOTALL)
    assert stub and stub.group(1).endswith("const float* __restrict__ x, float* __restrict__ y, Params p")
    assert stub.group(2) == "fused_kernel<<<kl_grid, kl_block, kl_smem, kl_stream>>>(x, y, p);"
    # the wrappers: the launch is the stub's call with the same configuration and arguments
    assert "<<<" not in sp.host and "__global__" not in sp.host and "__device__" not in sp.host
    assert (f"{STUB_PREFIX}fused_kernel(ceil_div(p.n, BLOCK), BLOCK, 0, at::cuda::getCurrentCUDAStream(), "
            "x.data_ptr<float>(), y.data_ptr<float>(), p);") in re.sub(r"\(\s+", "(", sp.host)
    assert sp.host.index(f"void {STUB_PREFIX}fused_kernel(") < sp.host.index("torch::Tensor fused_cuda(")
    assert "struct Params" in sp.host and "static int ceil_div" in sp.host and '"{ ; }"' in sp.host
    assert "<ATen/cuda/CUDAContext.h>" in sp.host and "<ATen/cuda/CUDAContext.h>" not in sp.device


def test_two_and_three_part_launch_configurations_get_the_defaults():
    src = ("__global__ void k(float* y, int n) { y[0] = n; }\n"
           "torch::Tensor f(torch::Tensor x) { k<<<1, 32>>>(x.data_ptr<float>(), 3); "
           "k<<<dim3(2, 2), dim3(8, 8), 128>>>(x.data_ptr<float>(), 4); return x; }\n")
    host = split_cuda(src).host
    assert f"{STUB_PREFIX}k(1, 32, 0, 0, x.data_ptr<float>(), 3)" in host
    assert f"{STUB_PREFIX}k(dim3(2, 2), dim3(8, 8), 128, 0, x.data_ptr<float>(), 4)" in host


def test_types_and_constants_go_to_both_sides():
    src = ("template <int N> struct Tile { float v[N]; };\ntypedef float real;\nusing idx = long;\n"
           "static const int W = 4;\nenum class Mode { A, B };\n"
           "__global__ void k(float* y, Tile<4> t, real s, idx n) { y[0] = t.v[0] * s + W; }\n"
           "torch::Tensor f(torch::Tensor x) { Tile<4> t{}; k<<<1, 1>>>(x.data_ptr<float>(), t, 2.f, 3); return x; }\n")
    sp = split_cuda(src)
    for decl in ("template <int N> struct Tile", "typedef float real;", "using idx = long;", "static const int W = 4;",
                 "enum class Mode"):
        assert decl in sp.device and decl in sp.host, decl
    assert "torch::Tensor f(" in sp.host and "torch::Tensor f(" not in sp.device


def test_a_wrapper_may_share_its_kernels_name():
    """KernelBench's and the bench's wrappers often overload their kernel's name."""
    src = ("__global__ void scale_add(const float* x, float* y, long n) { }\n"
           "torch::Tensor scale_add(torch::Tensor x) { auto y = torch::empty_like(x);\n"
           "  scale_add<<<1, 1>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel()); return y; }\n")
    sp = split_cuda(src)
    assert sp is not None and "torch::Tensor scale_add(torch::Tensor x)" in sp.host


@pytest.mark.parametrize("why, src", [
    ("a templated kernel (AT_DISPATCH)",
     "template <typename scalar_t> __global__ void k(scalar_t* y) { }\n"
     "torch::Tensor f(torch::Tensor x) { AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), \"f\", ([&] {\n"
     "  k<scalar_t><<<1, 1>>>(x.data_ptr<scalar_t>()); })); return x; }"),
    ("the kernel as a function pointer",
     "__global__ void k(float* y) { }\n"
     "torch::Tensor f(torch::Tensor x) { cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 1 << 16);\n"
     "  k<<<1, 1, 1 << 16>>>(x.data_ptr<float>()); return x; }"),
    ("conditional preprocessing",
     "#ifdef FAST\n#define N 4\n#endif\n__global__ void k(float* y) { }\n"
     "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); return x; }"),
    ("torch in device code",
     "__global__ void k(torch::PackedTensorAccessor32<float, 1> a) { a[0] = 1.f; }\n"
     "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.packed_accessor32<float, 1>()); return x; }"),
    ("a namespace", "namespace { __global__ void k(float* y) { } }\n"
     "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); return x; }"),
    ("a launch of something not a kernel of the file",
     "__global__ void k(float* y) { }\ntorch::Tensor f(torch::Tensor x) { other<<<1, 1>>>(x.data_ptr<float>()); return x; }"),
    ("overloaded kernels (a stub could take the other's arguments)",
     "__global__ void k(float* y, float a) { }\n__global__ void k(float* y, int a) { }\n"
     "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>(), 2); return x; }"),
    ("no launch from host code", "__global__ void k(float* y) { }\ntorch::Tensor f(torch::Tensor x) { return x; }"),
    ("unbalanced braces", "__global__ void k(float* y) { \ntorch::Tensor f(torch::Tensor x) { return x; }"),
    ("a kernel with a defaulted parameter", "__global__ void k(float* y, int n = 4) { }\n"
     "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); return x; }"),
])
def test_sources_the_split_cannot_be_sure_of_stay_whole(why, src):
    assert split_cuda(src) is None, why


def test_items_keep_literals_and_drop_comments():
    parsed = items('#include <a.h>\nstruct S { int a; } s;\n// x { \nint f() { return "}"[0]; }\nconst int z = 1;\n')
    assert [i.kind for i in parsed] == ["pp", "block", "block", "decl"]
    assert parsed[1].text == "struct S { int a; } s;" and '"}"' in parsed[2].text


def test_the_split_is_the_first_try_and_any_failure_goes_to_the_minimal_headers(monkeypatch):
    from sandbox.header_tries import CUDA_SPLIT_ENV

    monkeypatch.setenv(CUDA_SPLIT_ENV, "0")              # switched off: no split try
    assert SPLIT_NOTE not in [t.note for t in header_tries([KB], False, ("/lite",), ["int g();"], ["-l:g.so"])]
    monkeypatch.delenv(CUDA_SPLIT_ENV, raising=False)    # on by default
    tries = header_tries([KB], False, ("/lite",), ["torch::Tensor fused_cuda(torch::Tensor x, double scale);"],
                         ["-l:g.so"])
    assert [(t.note, t.raw) for t in tries[:5]] == [(SPLIT_NOTE, True), (SPLIT_NOTE, False), (SPLIT_FULL_NOTE, False),
                                                    (MINIMAL_NOTE, True), (MINIMAL_NOTE, False)]
    full = tries[2]
    assert full.cuda == tries[0].cuda and full.cpp == tries[0].cpp and full.cpp_prefix == ("#include <torch/extension.h>",)
    split = tries[0]
    assert len(split.cuda) == 1 and "torch" not in split.cuda[0].replace("TORCH_CHECK", "")
    assert not any("torch/extension.h" in c for c in split.cpp) and "fused_cuda(" in split.cpp[0]
    assert split.cpp[-1] == "torch::Tensor fused_cuda(torch::Tensor x, double scale);"
    from sandbox.header_tries import next_try
    # a torch name the lean binding's headers lack: the split on torch/extension.h; any other error:
    # the whole file with the minimal headers (whose failure goes on to the candidate's own)
    assert next_try(tries, 0, "error: 'matmul' is not a member of 'torch'") == 2
    assert next_try(tries, 0, "error: 'j' was not declared in this scope") == 3
    assert next_try(tries, 2, "error: 'j' was not declared in this scope") == 3
    # without the lean binding's directory (no lighter headers) there is no split
    assert SPLIT_NOTE not in [t.note for t in header_tries([KB], False)]


@pytest.mark.gpu
def test_a_split_candidate_is_judged_correct_on_a_gpu(monkeypatch):
    """The adversarial suite's honest CUDA candidate (a KernelBench-style wrapper in the .cu file)
    built split and judged by the sandbox on a GPU: the stubs launch the kernels as written."""
    from sandbox.evaluate import evaluate
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, Status
    from sandbox.tasks import read_spec

    from sandbox.header_tries import CUDA_SPLIT_ENV

    monkeypatch.setenv(CUDA_SPLIT_ENV, "1")              # the sandbox's build workers start after this
    root = Path(__file__).parent / "adversarial"
    spec = read_spec(root / "task_small.py", name="adversarial/task_small")
    cfg = EvalConfig(numerics=Numerics(), trials=2, warmup_runs=1, timed_runs=3, time_compile=False, profile=True)
    result = remeasured(lambda: evaluate(spec, (root / "cuda" / "honest.py").read_text(), "cuda", cfg))
    assert result.status is Status.correct and result.clean, (result.status, result.error_message, result.flags)
    # the split is the build's first note (the raw binding's note may follow it)
    assert result.build.notes and result.build.notes[0] == SPLIT_NOTE, result.build.notes
    assert any(k.own and "relu_scale_kernel" in k.name for k in result.profile or []), result.profile
