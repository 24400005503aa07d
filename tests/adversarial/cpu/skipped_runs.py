# expect-status: incorrect
# expect-flag: 
# expect-reason: sampled
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

# Exploit (issue 15): count forward calls and, on some timed runs (never the last), skip the
# work and return the previous output with a cheap decoy touch. The trials (the first four
# calls) and the last timed run are honest: a check of two timed runs catches it by luck only.
# With the adversarial suite's CPU config (3 trials = 4 calls, 1 warm-up, 5 timed runs) calls
# 6 and 8 are timed runs 0 and 2.
SKIPPED_CALLS = {6, 8}


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
