import torch
import torch.nn as nn


class Model(nn.Module):
    """Group normalization of an image batch."""

    def __init__(self, num_groups: int, num_channels: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


batch_size = 128
channels = 64
num_groups = 8
height = 256
width = 256

CPU_SIZES = {"batch_size": 4, "channels": 16, "num_groups": 4, "height": 32, "width": 32}


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [num_groups, channels]
