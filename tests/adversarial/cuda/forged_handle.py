# expect-status: incorrect
# expect-flag: 
# expect-reason: outside
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline
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

# Exploit: wrong outputs, described by a well-formed IPC handle nobody shared, hoping the
# reference, unable to map it, passes the comparison or blames itself (an infra error, retried
# and never judged). It must ask for the same outputs as a file and judge those.
import sys

_handoff = sys.modules["sandbox.handoff"]
_share = _handoff.Exported.share


def _forged(self, tensors, name):
    items = _share(self, tensors, name)
    for item in items:
        if "handle" in item:
            item["handle"] = item["handle"][:-128] + "00" * 64     # torch's prefix, a payload nobody shared
    return items


_handoff.Exported.share = _forged


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x).contiguous(), self.scale) * 0.5
