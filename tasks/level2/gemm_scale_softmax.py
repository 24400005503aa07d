import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, multiply by a temperature factor, softmax over features."""

    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        x = self.linear(x)
        x = x * self.scale
        x = torch.softmax(x, dim=1)
        return x


batch_size = 16384
in_features = 4096
out_features = 1024
scale = 4.0

CPU_SIZES = {"batch_size": 64, "in_features": 256, "out_features": 256}


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale]
