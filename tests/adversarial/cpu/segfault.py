# expect-status: runtime_error
# expect-flag: 
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Failure: dereferences a null pointer.
CPP = r"""
torch::Tensor crash(torch::Tensor x) {
  volatile float* p = nullptr;
  p[0] = 1.0f;
  return x;
}
"""
ext = load_inline(name="adv_crash", cpp_sources=[CPP], functions=["crash"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return ext.crash(self.linear(x))
