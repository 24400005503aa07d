# expect-status: incorrect|flagged
# expect-flag: inaccurate
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Shortcut that no static pattern names: keep 15 of the 24 significand bits (a relative error
# of at most 2^-15, inside rtol=1e-4), as a kernel storing a narrower format would. Only the
# float64 check sees it.
CUDA = r"""
__global__ void relu_scale_kernel(const float* __restrict__ x, float* __restrict__ y, float s, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) {
    float v = x[i];
    v = (v > 0.f ? v : 0.f) * s;
    y[i] = __uint_as_float(__float_as_uint(v) & 0xffffff00u);
  }
}
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  long n = x.numel();
  relu_scale_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
  return y;
}
"""
CPP = "torch::Tensor relu_scale(torch::Tensor x, double s);"
ext = load_inline(name="adv_relu_scale_trunc_cuda", cpp_sources=[CPP], cuda_sources=[CUDA], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x).contiguous(), self.scale)
