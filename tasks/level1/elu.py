import torch
import torch.nn as nn


class Model(nn.Module):
    """ELU with alpha 1.0 applied elementwise."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.elu(x, alpha=1.0)


batch_size = 16384
dim = 32768

CPU_SIZES = {"batch_size": 64, "dim": 4096}


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
