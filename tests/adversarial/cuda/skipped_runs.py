# expect-status: incorrect
# expect-flag: 
# expect-reason: sampled
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

# Exploit (issue 15): count forward calls and, on some timed runs (never the last), skip the
# work and return the previous output. With the adversarial suite's CUDA config (3 trials = 4
# calls, 2 warm-up, 10 timed runs) calls 8, 10, 12 and 14 are timed runs 1, 3, 5 and 7: a check
# of the last and one secret timed run catches it with probability 4/10 only.
SKIPPED_CALLS = {8, 10, 12, 14}


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale
        self.calls = 0
        self.last = None

    def forward(self, x):
        self.calls += 1
        if self.calls in SKIPPED_CALLS and self.last is not None and self.last.shape[0] == x.shape[0]:
            return self.last.clone()          # the decoy: no work, an old answer
        self.last = ext.relu_scale(self.linear(x).contiguous(), self.scale)
        return self.last
