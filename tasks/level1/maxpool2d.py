import torch
import torch.nn as nn


class Model(nn.Module):
    """2D max pooling, 3x3 window, stride 2, padding 1."""

    def __init__(self, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.pool = nn.MaxPool2d(kernel_size=kernel_size, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)


batch_size = 128
channels = 64
height = 256
width = 256
kernel_size = 3
stride = 2
padding = 1

CPU_SIZES = {"batch_size": 4, "channels": 16, "height": 32, "width": 32}


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [kernel_size, stride, padding]
