import torch
import torch.nn as nn


class Model(nn.Module):
    """Transposed 2D convolution that doubles the spatial size (kernel 4, stride 2, padding 1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.conv_t = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_t(x)


batch_size = 64
in_channels = 128
out_channels = 64
kernel_size = 4
stride = 2
padding = 1
height = 128
width = 128

CPU_SIZES = {"batch_size": 2, "in_channels": 16, "out_channels": 8, "height": 16, "width": 16}


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
