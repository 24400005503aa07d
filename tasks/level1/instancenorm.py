import torch
import torch.nn as nn


class Model(nn.Module):
    """Instance normalization: every (sample, channel) plane normalized on its own."""

    def __init__(self, num_features: int):
        super().__init__()
        self.inorm = nn.InstanceNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(x)


batch_size = 64
features = 64
height = 256
width = 256

CPU_SIZES = {"batch_size": 4, "features": 16, "height": 32, "width": 32}


def get_inputs():
    return [torch.randn(batch_size, features, height, width)]


def get_init_inputs():
    return [features]
