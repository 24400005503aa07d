# expect-status: incorrect|flagged
# expect-flag: precision
# The whole layer in one Triton kernel, its tl.dot left at Triton's default precision: TF32 for
# float32 inputs on the GPU (10-bit mantissas). The scan notes it; the GPU's result (and, on the
# CPU, the interpreter's tl.dot with its operands rounded to TF32 as the GPU would) measures it.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def linear_relu_scale_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, scale,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.dot(a, w)
    bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
    y = acc + bias[None, :]
    y = tl.where(y < 0.0, 0.0, y) * scale
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        x = x.contiguous()
        M, K = x.shape
        N = self.linear.weight.shape[0]
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(M, 32), triton.cdiv(N, 32))
        linear_relu_scale_kernel[grid](x, self.linear.weight, self.linear.bias, out, M, N, K, self.scale,
                                       BM=32, BN=32, BK=32)
        return out
