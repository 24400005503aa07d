# expect-status: correct
# The reference's own TF32-like rounding (10 bits), another summation order: correct, as a cuDNN TF32 kernel is in the default mode.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <cstring>
static inline float keep_bits(float v, int bits) {
  if (bits >= 23) return v;
  int32_t i; std::memcpy(&i, &v, 4);
  const int drop = 23 - bits;
  i = (i + (1 << (drop - 1))) & ~((1 << drop) - 1);
  std::memcpy(&v, &i, 4);
  return v;
}
torch::Tensor gemm_nt(torch::Tensor x, torch::Tensor w, int64_t bits, int64_t block) {
  x = x.contiguous(); w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* a = x.data_ptr<float>(); const float* b = w.data_ptr<float>(); float* c = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float total = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += block) {          // blocked sums: another order than PyTorch's
        float part = 0.f;
        for (int64_t k = k0; k < k0 + block && k < K; ++k)
          part += keep_bits(a[m * K + k], (int)bits) * keep_bits(b[n * K + k], (int)bits);
        total += part;
      }
      c[m * N + n] = total;
    }
  return y;
}
"""
ext = load_inline(name="numerics_gemm_nt", cpp_sources=[CPP], functions=["gemm_nt"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x):
        return ext.gemm_nt(x, self.weight, 10, 64)
