# expect-status: incorrect
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

# Exploit: compute once, return the same output for every later input.

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

        self._out = None

    def forward(self, x):
        if self._out is None:
            self._out = ext.relu_scale(self.linear(x).contiguous(), self.scale)
        return self._out
