"""A register-blocked float32 direct convolution, measured beside cuDNN (GPU host; an experiment).

The builtin's FMA tiles (`templates/cuda_conv.cu.j2`) reach about a third of the fp32 FMA peak on
KernelBench level 2's 8-to-64-channel 3x3 convolutions. This kernel tries the GEMM way of blocking
instead: a thread keeps 8 consecutive output columns x 8 output channels (64 accumulators); for each
input channel and kernel row it reads its 10 input values in three vector loads and, per kernel
column, 8 weights in two vector loads, then issues 64 FMAs (9 shared loads per 192 FMAs). A warp is
one channel group (the weights broadcast); the outputs leave through a per-warp shared-memory
transpose so that a warp stores 32 consecutive columns. Epilogues: `store` (bias, two subtractions and
Mish: level2/87), `gelu_mean` (bias, GELU, the mean over the image, no store: level2/67), `bn_stats`
(bias, store, per-channel sum and sum of squares: level2/73's convolution and statistics pass).

    source scripts/gpu_env.sh && python3 scripts/conv_lab.py
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

#define TH 8
#define TW 32
#define PX 8
#define CT 8
#define IWP 36

__device__ __forceinline__ float mish(float a) {
  if (a > 20.f) return a;
  const float e = __expf(a);
  const float p = e * (e + 2.f);
  return a * __fdividef(p, p + 2.f);
}
__device__ __forceinline__ float gelu(float a) { return 0.5f * a * (1.f + erff(a * 0.70710678118654752f)); }

template <int CI, int EPI>
__global__ void __launch_bounds__(256, 2) conv_r(const float* __restrict__ x, const float* __restrict__ w,
    const float* __restrict__ b, float* __restrict__ y, float* __restrict__ red, int H, int W, int OH, int OW,
    int tiles_x, int tiles_y) {
  constexpr int CO = 64, IH = TH + 2, K = CI * 9;
  extern __shared__ float4 smem4[];
  float* s_in = reinterpret_cast<float*>(smem4);        // [CI][IH][IWP]
  float* s_w = s_in + CI * IH * IWP;                     // [K][CO]
  const int tid = threadIdx.x;
  int blk = blockIdx.x;
  const int tx = blk % tiles_x; blk /= tiles_x;
  const int ty = blk % tiles_y; const int n = blk / tiles_y;
  const int oy0 = ty * TH, ox0 = tx * TW;
  for (int e = tid; e < CO * K; e += 256) {
    const int k = e / CO, co = e - k * CO;
    s_w[e] = w[co * K + k];
  }
  for (int e = tid; e < CI * IH * (TW + 2); e += 256) {
    const int xx = e % (TW + 2); const int r = e / (TW + 2);
    const int yy = r % IH, ci = r / IH;
    const int iy = oy0 + yy, ix = ox0 + xx;
    s_in[(ci * IH + yy) * IWP + xx] = (iy < H && ix < W) ? x[((n * CI + ci) * H + iy) * W + ix] : 0.f;
  }
  __syncthreads();
  const int lane = tid & 31, cg = tid >> 5, r = lane >> 2, px0 = (lane & 3) * PX;
  float acc[PX][CT];
#pragma unroll
  for (int p = 0; p < PX; ++p)
#pragma unroll
    for (int c = 0; c < CT; ++c) acc[p][c] = 0.f;
#pragma unroll 1
  for (int ci = 0; ci < CI; ++ci) {
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
      const float* row = s_in + (ci * IH + r + ky) * IWP + px0;
      const float4 a0 = *reinterpret_cast<const float4*>(row);
      const float4 a1 = *reinterpret_cast<const float4*>(row + 4);
      const float2 a2 = *reinterpret_cast<const float2*>(row + 8);
      const float v[10] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w, a2.x, a2.y};
#pragma unroll
      for (int kx = 0; kx < 3; ++kx) {
        const float4* wp = reinterpret_cast<const float4*>(s_w + ((ci * 3 + ky) * 3 + kx) * CO + cg * CT);
        const float4 w0 = wp[0], w1 = wp[1];
        const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int p = 0; p < PX; ++p)
#pragma unroll
          for (int c = 0; c < CT; ++c) acc[p][c] = fmaf(v[p + kx], wv[c], acc[p][c]);
      }
    }
  }
  __syncthreads();                                       // s_in becomes the warps' transpose areas
  float* s_o = s_in + cg * (TH * IWP);
  const int oy_last = OH - oy0 < TH ? OH - oy0 : TH;
  const int ox = ox0 + lane;
#pragma unroll
  for (int c = 0; c < CT; ++c) {
    const int co = cg * CT + c;
    float* mine = s_o + r * IWP + px0;
    *reinterpret_cast<float4*>(mine) = make_float4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]);
    *reinterpret_cast<float4*>(mine + 4) = make_float4(acc[4][c], acc[5][c], acc[6][c], acc[7][c]);
    __syncwarp();
    const float bias = b[co];
    float s = 0.f, s2 = 0.f;
#pragma unroll
    for (int rr = 0; rr < TH; ++rr) {
      const float v = s_o[rr * IWP + lane] + bias;
      const bool in = rr < oy_last && ox < OW;
      if (EPI == 0) {
        const float z = mish(v - 0.5f - 0.2f);
        if (in) y[((size_t)(n * CO + co) * OH + oy0 + rr) * OW + ox] = z;
      } else if (EPI == 1) {
        if (in) s += gelu(v);
      } else {
        if (in) { y[((size_t)(n * CO + co) * OH + oy0 + rr) * OW + ox] = v; s += v; s2 += v * v; }
      }
    }
    if (EPI != 0) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) { s += __shfl_xor_sync(0xffffffffu, s, o); s2 += __shfl_xor_sync(0xffffffffu, s2, o); }
      if (lane == 0) {
        if (EPI == 1) atomicAdd(red + n * CO + co, s / (float)(OH * OW));
        else { atomicAdd(red + co, s); atomicAdd(red + CO + co, s2); }
      }
    }
    __syncwarp();
  }
}

void run(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor red, int64_t epi) {
  const int N = x.size(0), CI = x.size(1), H = x.size(2), W = x.size(3), OH = H - 2, OW = W - 2;
  const int tiles_x = (OW + TW - 1) / TW, tiles_y = (OH + TH - 1) / TH;
  const size_t smem = (size_t)(CI * (TH + 2) * IWP + CI * 9 * 64) * 4;
  auto st = at::cuda::getCurrentCUDAStream();
  float* yp = y.numel() ? y.data_ptr<float>() : nullptr;
#define LAUNCH(E) do { \
    cudaFuncSetAttribute(conv_r<8, E>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem); \
    conv_r<8, E><<<N * tiles_x * tiles_y, 256, smem, st>>>(x.data_ptr<float>(), w.data_ptr<float>(), \
        b.data_ptr<float>(), yp, red.data_ptr<float>(), H, W, OH, OW, tiles_x, tiles_y); } while (0)
  TORCH_CHECK(CI == 8 && w.size(0) == 64, "the lab kernel is for 8 -> 64 channels");
  if (epi == 0) LAUNCH(0); else if (epi == 1) LAUNCH(1); else LAUNCH(2);
}
"""
CPP = "void run(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor red, int64_t epi);"


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default="256,128")
    args = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    mod = load_inline("conv_lab", CPP, cuda_sources=[CUDA.replace("#include <torch/extension.h>",
                      "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>")], functions=["run"],
                      extra_cuda_cflags=["-O3"], verbose=False)
    print(f"{torch.cuda.get_device_name()}: numerics fp32 (cuDNN's TF32 off; the lab kernel float32 FMAs); "
          f"CUDA events, median of {args.reps} runs after 2 warm-ups; TFLOP/s = 2 x N x C_out x OH x OW x C_in x 9 / time",
          flush=True)
    for size in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        x = torch.rand(128, 8, size, size, device="cuda")
        conv = torch.nn.Conv2d(8, 64, 3).cuda()
        w, b = conv.weight.detach().contiguous(), conv.bias.detach().contiguous()
        oh = size - 2
        flops = 2 * 128 * 64 * oh * oh * 72
        with torch.no_grad():
            ref = F.conv2d(x, w, b)
            ref64 = F.conv2d(x.double(), w.double(), b.double())
            t_cudnn = _median_ms(lambda: F.conv2d(x, w, b), args.reps)
            print(f"{size}x{size}: cuDNN fp32 {t_cudnn:.3f} ms ({flops / t_cudnn / 1e9:.1f} TFLOP/s)", flush=True)
            y = torch.empty_like(ref)
            red = torch.zeros(2 * 128 * 64, device="cuda")
            want = {0: F.mish(ref64 - 0.5 - 0.2), 2: ref64}
            for epi, name in ((0, "store (87's Mish)"), (1, "gelu_mean (67)"), (2, "bn_stats (73)")):
                red.zero_()
                mod.run(x, w, b, y, red, epi)
                torch.cuda.synchronize()
                if epi == 1:
                    got, exp = red[:128 * 64].view(128, 64), F.gelu(ref64).mean((2, 3))
                elif epi == 2:
                    got, exp = torch.cat([y.flatten(), red[:128]]), torch.cat([ref64.flatten(), ref64.sum((0, 2, 3)),
                                                                             (ref64 * ref64).sum((0, 2, 3))])
                else:
                    got, exp = y, want[0]
                err = ((got.double() - exp).abs().max() / exp.abs().max()).item()
                t = _median_ms(lambda: (red.zero_(), mod.run(x, w, b, y, red, epi)), args.reps)
                print(f"  {name:20s} {t:.3f} ms ({flops / t / 1e9:.1f} TFLOP/s), max error / max |ref64| {err:.2e}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
