import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, Swish (x * sigmoid(x)), then a constant scale."""

    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.linear(x)
        x = x * torch.sigmoid(x)
        x = x * self.scaling_factor
        return x


batch_size = 8192
in_features = 4096
out_features = 4096
scaling_factor = 2.0

CPU_SIZES = {"batch_size": 64, "in_features": 256, "out_features": 256}


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor]
