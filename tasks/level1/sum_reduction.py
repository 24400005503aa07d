import torch
import torch.nn as nn


class Model(nn.Module):
    """Sum over one dimension, keeping it as size 1."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x, dim=self.dim, keepdim=True)


batch_size = 768
dim1 = 256
dim2 = 4096
reduce_dim = 1

CPU_SIZES = {"batch_size": 16, "dim1": 64, "dim2": 256}


def get_inputs():
    return [torch.randn(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]
