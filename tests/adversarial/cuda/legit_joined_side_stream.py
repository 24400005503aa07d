# expect-status: clean
# expect-flag: 
# Legitimate: the candidate's own kernel runs on a side stream that waits for the caller's stream
# and is joined back to it (the caller's stream waits for the side stream) before the forward
# returns: the output is ready for whatever the caller queues next.
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
ext = load_inline(name="adv_relu_scale_joined", cpp_sources=[CPP], cuda_sources=["#include <ATen/cuda/CUDAContext.h>\n" + CUDA],
                  functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale
        self.side = None

    def forward(self, x):
        if self.side is None:
            self.side = torch.cuda.Stream()
        y = self.linear(x).contiguous()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = ext.relu_scale(y, self.scale)
            y.record_stream(self.side)
            out.record_stream(self.side)
        torch.cuda.current_stream().wait_stream(self.side)
        return out
