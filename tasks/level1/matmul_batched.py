import torch
import torch.nn as nn


class Model(nn.Module):
    """Batched matrix product: (b, m, k) @ (b, k, n)."""

    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.bmm(A, B)


batch_size = 128
m = 512
k = 1024
n = 512

CPU_SIZES = {"batch_size": 4, "m": 64, "k": 64, "n": 64}


def get_inputs():
    return [torch.randn(batch_size, m, k), torch.randn(batch_size, k, n)]


def get_init_inputs():
    return []
