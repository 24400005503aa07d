# expect-status: correct
# Run under --precision bf16 on tests/adversarial/task_small.py: reads and writes bfloat16,
# computes in float, rounds once on store.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = r"""
torch::Tensor relu_scale(torch::Tensor x, double s) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "relu_scale: bfloat16 expected");
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const at::BFloat16* p = x.data_ptr<at::BFloat16>(); at::BFloat16* q = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = static_cast<float>(p[i]);
    q[i] = static_cast<at::BFloat16>((v > 0.f ? v : 0.f) * (float)s);
  }
  return y;
}
"""
ext = load_inline(name="numerics_relu_scale_bf16", cpp_sources=[CPP], functions=["relu_scale"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return ext.relu_scale(self.linear(x), self.scale)
