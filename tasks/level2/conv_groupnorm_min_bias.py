import torch
import torch.nn as nn


class Model(nn.Module):
    """Convolution, group normalization, minimum with a constant, add a learned per-channel bias."""

    def __init__(self, in_channels, out_channels, kernel_size, num_groups, min_value, bias_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = nn.GroupNorm(num_groups, out_channels)
        self.min_value = min_value
        self.bias = nn.Parameter(torch.randn(bias_shape) * 0.1)

    def forward(self, x):
        x = self.conv(x)
        x = self.group_norm(x)
        x = torch.clamp(x, max=self.min_value)
        x = x + self.bias
        return x


batch_size = 128
in_channels = 64
out_channels = 128
height = width = 128
kernel_size = 3
num_groups = 8
min_value = 0.5

CPU_SIZES = {"batch_size": 2, "in_channels": 8, "out_channels": 16, "height": 24, "width": 24, "num_groups": 4}


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, num_groups, min_value, (out_channels, 1, 1)]
