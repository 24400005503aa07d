import torch
import torch.nn as nn


class Model(nn.Module):
    """Convolution, HardSwish, then the mean over the spatial dimensions (one value per channel)."""

    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)

    def forward(self, x):
        x = self.conv(x)
        x = torch.nn.functional.hardswish(x)
        x = torch.mean(x, dim=(2, 3))
        return x


batch_size = 1024
in_channels = 64
out_channels = 128
height = width = 32
kernel_size = 3

CPU_SIZES = {"batch_size": 16, "in_channels": 8, "out_channels": 16, "height": 16, "width": 16}


def get_inputs():
    # A per-sample brightness offset makes the spatial means differ between samples.
    return [torch.randn(batch_size, in_channels, height, width) + torch.randn(batch_size, 1, 1, 1)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
