import torch
import torch.nn as nn


class Model(nn.Module):
    """LeakyReLU with a configurable negative slope."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, negative_slope=self.negative_slope)


batch_size = 16384
dim = 32768
negative_slope = 0.05

CPU_SIZES = {"batch_size": 64, "dim": 4096}


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [negative_slope]
