# expect-status: runtime_error
# expect-flag: 
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = r"""
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) q[i] = (p[i] > 0.f ? p[i] : 0.f) * (float)s;
  return y;
}
torch::Tensor uninit_like(torch::Tensor x) { return torch::empty_like(x); }
"""
ext = load_inline(name="adv_relu_scale", cpp_sources=[CPP], functions=["relu_scale", "uninit_like"])

# Failure: asks for far more memory than the worker may have.

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        big = torch.empty(1 << 40, dtype=torch.uint8)
        big.fill_(1)
        return ext.relu_scale(self.linear(x).contiguous(), self.scale)
