# expect-status: flagged|incorrect
# expect-flag: suspicious
# expect-device: gpu
# Launches its kernel on a side stream and returns without waiting: the caller's stream may read
# the output before it is written. Flagged by the scan; the timing's device-wide synchronize counts
# the side stream's work.
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def relu_scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.where(x < 0.0, 0.0, x) * scale, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        y = F.linear(x, self.linear.weight, self.linear.bias).contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            relu_scale_kernel[(triton.cdiv(n, 1024),)](y, out, n, self.scale, BLOCK=1024)
        return out
