# A reference that computes like cuDNN's TF32 convolutions under PyTorch's default math on a
# GPU, on the CPU: in float32 it rounds both GEMM operands to 10 significand bits (TF32) first;
# its float64 copy computes exactly. Used by tests/test_numerics_sandbox.py.
import torch
import torch.nn as nn


def round_tf32(x):
    if x.dtype != torch.float32:
        return x                       # the float64 run: no rounding
    i = x.view(torch.int32)
    return ((i + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x):
        return round_tf32(x) @ round_tf32(self.weight).t()


batch_size = 64
in_features = 1024
out_features = 96


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
