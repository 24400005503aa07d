import torch
import torch.nn as nn


class Model(nn.Module):
    """Softplus with a sharpness beta and a linear-region threshold."""

    def __init__(self, beta: float, threshold: float):
        super().__init__()
        self.beta = beta
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(x, beta=self.beta, threshold=self.threshold)


batch_size = 16384
dim = 32768
beta = 2.0
threshold = 10.0

CPU_SIZES = {"batch_size": 64, "dim": 4096}


def get_inputs():
    return [torch.randn(batch_size, dim) * 3.0]


def get_init_inputs():
    return [beta, threshold]
