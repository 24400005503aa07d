import torch
import torch.nn as nn


class Model(nn.Module):
    """Convolution, ELU, multiplied by a learned per-channel factor."""

    def __init__(self, in_channels, out_channels, kernel_size, multiplier_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.multiplier = nn.Parameter(1.0 + torch.randn(multiplier_shape) * 0.25)

    def forward(self, x):
        x = self.conv(x)
        x = torch.nn.functional.elu(x)
        x = x * self.multiplier
        return x


batch_size = 128
in_channels = 64
out_channels = 128
height = width = 128
kernel_size = 3

CPU_SIZES = {"batch_size": 2, "in_channels": 8, "out_channels": 16, "height": 24, "width": 24}


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, (out_channels, 1, 1)]
