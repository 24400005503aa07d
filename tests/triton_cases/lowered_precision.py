# expect-status: incorrect|flagged
# expect-flag: inaccurate
# Keeps 15 of float32's 24 significand bits (a relative error below 2^-15, inside rtol=1e-4), as a
# kernel storing a narrower format would; no static pattern names it. Only the float64 rule sees it.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_relu_scale_kernel(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    v = tl.maximum(x + y, 0.0) * scale
    v = (v.to(tl.uint32, bitcast=True) & 0xFFFFFF00).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, v, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        x, y = x.contiguous(), y.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        add_relu_scale_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, self.scale, BLOCK=1024)
        return out
