import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer whose output is scaled and added back to itself (y*s + y)."""

    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.linear(x)
        residual = x.clone().detach()
        x = x * self.scaling_factor
        x = x + residual
        return x


batch_size = 8192
in_features = 4096
out_features = 4096
scaling_factor = 0.5

CPU_SIZES = {"batch_size": 64, "in_features": 256, "out_features": 256}


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor]
