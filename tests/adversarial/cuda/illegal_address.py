# expect-status: runtime_error
# expect-flag: 
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Failure: a kernel that writes far outside its allocation (an illegal memory access).
CUDA = r"""
__global__ void wild_write(float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i * (1L << 32)] = 1.0f;
}
torch::Tensor wild(torch::Tensor x) {
  auto y = torch::empty_like(x);
  long n = x.numel();
  wild_write<<<(n + 255) / 256, 256>>>(y.data_ptr<float>(), n);
  return y;
}
"""
CPP = "torch::Tensor wild(torch::Tensor x);"
ext = load_inline(name="adv_wild", cpp_sources=[CPP], cuda_sources=[CUDA], functions=["wild"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return ext.wild(self.linear(x).contiguous())
