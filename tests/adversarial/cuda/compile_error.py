# expect-status: compile_error
# expect-flag: 
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Failure: a loop variable that was never declared, inside a CUDA kernel.
CUDA = r"""
__global__ void relu_scale_kernel(const float* x, float* y, float s, long n) {
  for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = x[i] * s;
}
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  relu_scale_kernel<<<64, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)s, x.numel());
  return y;
}
"""
CPP = "torch::Tensor relu_scale(torch::Tensor x, double s);"
ext = load_inline(name="adv_bad_cuda", cpp_sources=[CPP], cuda_sources=[CUDA], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x), self.scale)
