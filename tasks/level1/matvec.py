import torch
import torch.nn as nn


class Model(nn.Module):
    """Matrix-vector product: (M, K) @ (K, 1)."""

    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, v)


M = 16384
K = 49152

CPU_SIZES = {"M": 1024, "K": 2048}


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, 1)]


def get_init_inputs():
    return []
