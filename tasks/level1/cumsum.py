import torch
import torch.nn as nn


class Model(nn.Module):
    """Inclusive prefix sum along one dimension."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=self.dim)


batch_size = 16384
length = 32768
scan_dim = 1

CPU_SIZES = {"batch_size": 64, "length": 4096}


def get_inputs():
    return [torch.randn(batch_size, length)]


def get_init_inputs():
    return [scan_dim]
