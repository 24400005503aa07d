import torch
import torch.nn as nn


class Model(nn.Module):
    """Log-softmax over dimension 1."""

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=self.dim)


batch_size = 65536
dim = 8192

CPU_SIZES = {"batch_size": 64, "dim": 1024}


def get_inputs():
    return [torch.randn(batch_size, dim) * 2.0]


def get_init_inputs():
    return [1]
