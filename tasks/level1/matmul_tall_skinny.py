import torch
import torch.nn as nn


class Model(nn.Module):
    """A tall matrix times a small one: (M, K) @ (K, N) with M much larger than K and N."""

    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)


M = 131072
K = 1024
N = 256

CPU_SIZES = {"M": 4096, "K": 128, "N": 32}


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs():
    return []
