# expect-status: incorrect|flagged
# expect-flag: inaccurate
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Shortcut that no static pattern names: keep 15 of the 24 significand bits (a relative error
# of at most 2^-15, inside rtol=1e-4), as a kernel storing a narrower format would. Only the
# float64 check sees it.
CPP = r"""
#include <cstring>
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    float v = (p[i] > 0.f ? p[i] : 0.f) * (float)s;
    uint32_t u; std::memcpy(&u, &v, 4); u &= 0xffffff00u; std::memcpy(&v, &u, 4);
    q[i] = v;
  }
  return y;
}
"""
ext = load_inline(name="adv_relu_scale_trunc", cpp_sources=[CPP], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x).contiguous(), self.scale)
