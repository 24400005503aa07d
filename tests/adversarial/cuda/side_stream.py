# expect-status: flagged|incorrect
# expect-flag: suspicious
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
  relu_scale_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
  return y;
}
torch::Tensor uninit_like(torch::Tensor x) { return torch::empty_like(x); }
"""
CPP = "torch::Tensor relu_scale(torch::Tensor x, double s);\ntorch::Tensor uninit_like(torch::Tensor x);"
ext = load_inline(name="adv_relu_scale_cuda", cpp_sources=[CPP], cuda_sources=[CUDA], functions=["relu_scale", "uninit_like"])

# Exploit: launch the work on a side stream so a default-stream timer misses it.
_side = None

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        global _side
        if _side is None:
            _side = torch.cuda.Stream()
        y = self.linear(x).contiguous()
        _side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(_side):
            out = ext.relu_scale(y, self.scale)
        return out
