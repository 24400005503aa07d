import torch
import torch.nn as nn


class Model(nn.Module):
    """1D convolution over sequences, stride 1, no padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


batch_size = 64
in_channels = 128
out_channels = 256
kernel_size = 5
length = 8192

CPU_SIZES = {"batch_size": 4, "in_channels": 16, "out_channels": 32, "length": 512}


def get_inputs():
    return [torch.randn(batch_size, in_channels, length)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
