# expect-status: compile_error
# expect-flag: 
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Failure: a loop variable that was never declared.
CPP = r"""
torch::Tensor relu_scale(torch::Tensor x, double s) {
  auto y = torch::empty_like(x);
  float* q = y.data_ptr<float>();
  for (j = 0; j < x.numel(); ++j) q[j] = 0.f;
  return y;
}
"""
ext = load_inline(name="adv_bad", cpp_sources=[CPP], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x), self.scale)
