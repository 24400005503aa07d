# task: level2/17_Conv2d_InstanceNorm_Divide
# expect: fp32/default=correct fp32/strict=correct
# Full fp32 convolution on a task cuDNN runs in TF32 by default: closer to float64 than the reference, correct in both modes.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# The convolution runs in cuDNN with its TF32 switch set from C++ for the call (mode 0: full fp32,
# 1: TF32, 2: the input and weights in half, 3: left as the harness set it), then the instance
# norm and the division run in this module's own kernel (float accumulation, any of
# float/half/bfloat16 storage).
CUDA = r"""
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
__device__ float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : 0.f;
  if (threadIdx.x < 32) for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  if (threadIdx.x == 0) sh[0] = v;
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}
template <typename T>
__global__ void inorm_div_kernel(const T* __restrict__ x, T* __restrict__ y, int plane, float inv_div, float eps) {
  __shared__ float sh[32];
  const T* p = x + (long)blockIdx.x * plane;
  T* q = y + (long)blockIdx.x * plane;
  float s = 0.f;
  for (int i = threadIdx.x; i < plane; i += blockDim.x) s += static_cast<float>(p[i]);
  const float mean = block_sum(s, sh) / plane;
  float v = 0.f;
  for (int i = threadIdx.x; i < plane; i += blockDim.x) { float d = static_cast<float>(p[i]) - mean; v += d * d; }
  const float rstd = rsqrtf(block_sum(v, sh) / plane + eps);
  for (int i = threadIdx.x; i < plane; i += blockDim.x)
    q[i] = static_cast<T>((static_cast<float>(p[i]) - mean) * rstd * inv_div);
}
void inorm_div_launch(const void* x, void* y, long planes, int plane, float inv_div, int kind) {
  if (kind == 0) inorm_div_kernel<float><<<planes, 512>>>((const float*)x, (float*)y, plane, inv_div, 1e-5f);
  else if (kind == 1) inorm_div_kernel<c10::Half><<<planes, 512>>>((const c10::Half*)x, (c10::Half*)y, plane, inv_div, 1e-5f);
  else inorm_div_kernel<c10::BFloat16><<<planes, 512>>>((const c10::BFloat16*)x, (c10::BFloat16*)y, plane, inv_div, 1e-5f);
}
"""
CPP = r"""
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
void inorm_div_launch(const void* x, void* y, long planes, int plane, float inv_div, int kind);
torch::Tensor conv_inorm_div(torch::Tensor x, torch::Tensor w, torch::Tensor b, double divide_by, int64_t mode) {
  auto& ctx = at::globalContext();
  const bool saved = ctx.allowTF32CuDNN();
  if (mode == 0 || mode == 1) ctx.setAllowTF32CuDNN(mode == 1);
  torch::Tensor h = mode == 2 ? at::conv2d(x.to(at::kHalf), w.to(at::kHalf), b.to(at::kHalf)).to(x.scalar_type())
                              : at::conv2d(x, w, b);
  ctx.setAllowTF32CuDNN(saved);
  h = h.contiguous();
  auto y = torch::empty_like(h);
  const int kind = h.scalar_type() == at::kFloat ? 0 : (h.scalar_type() == at::kHalf ? 1 : 2);
  inorm_div_launch(h.data_ptr(), y.data_ptr(), h.size(0) * h.size(1), (int)(h.size(2) * h.size(3)),
                   (float)(1.0 / divide_by), kind);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
"""
ext = load_inline(name="numerics_conv_inorm_div", cpp_sources=[CPP], cuda_sources=[CUDA], functions=["conv_inorm_div"])


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, divide_by):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.instance_norm = nn.InstanceNorm2d(out_channels)
        self.divide_by = divide_by

    def forward(self, x):
        return ext.conv_inorm_div(x, self.conv.weight, self.conv.bias, self.divide_by, 0)
