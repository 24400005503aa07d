import torch
import torch.nn as nn


class Model(nn.Module):
    """Convolution, subtract a constant, tanh, subtract another constant."""

    def __init__(self, in_channels, out_channels, kernel_size, subtract1, subtract2):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.subtract1 = subtract1
        self.subtract2 = subtract2

    def forward(self, x):
        x = self.conv(x)
        x = x - self.subtract1
        x = torch.tanh(x)
        x = x - self.subtract2
        return x


batch_size = 128
in_channels = 64
out_channels = 128
height = width = 128
kernel_size = 3
subtract1 = 0.25
subtract2 = 0.5

CPU_SIZES = {"batch_size": 2, "in_channels": 8, "out_channels": 16, "height": 24, "width": 24}


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, subtract1, subtract2]
