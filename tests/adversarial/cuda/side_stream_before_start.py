# expect-status: flagged|incorrect
# expect-flag: suspicious
# Exploit: the whole forward on a side stream that is joined back to the caller's stream (the caller
# waits for it) but never waits for the caller's stream in a forward: its kernels start while the
# clock's preamble (L2 flush, spin) still holds the caller's stream, before the start event, and
# their time is off the clock. The only fork is in __init__, where it means nothing: the static scan
# sees a fork and a join and is satisfied; the profile (the clock's preamble, then the forward) shows
# the kernels starting before the preamble ended (sandbox.profiling.ahead_of_clock).
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
__global__ void relu_scale_kernel(const float* __restrict__ x, float* __restrict__ y, float s, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) { float v = x[i]; y[i] = (v > 0.f ? v : 0.f) * s; }
}
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  long n = x.numel();
  relu_scale_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
  return y;
}
"""
CPP = "torch::Tensor relu_scale(torch::Tensor x, double s);"
ext = load_inline(name="adv_relu_scale_before_start", cpp_sources=[CPP],
                  cuda_sources=["#include <ATen/cuda/CUDAContext.h>\n" + CUDA], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale
        self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())     # once, at construction: no fork per forward

    def forward(self, x):
        with torch.cuda.stream(self.side):
            out = ext.relu_scale(self.linear(x).contiguous(), self.scale)
            x.record_stream(self.side)
            out.record_stream(self.side)
        torch.cuda.current_stream().wait_stream(self.side)     # joined, so the output is ready
        return out
