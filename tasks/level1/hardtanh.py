import torch
import torch.nn as nn


class Model(nn.Module):
    """HardTanh: clamps every element into [min_val, max_val]."""

    def __init__(self, min_val: float, max_val: float):
        super().__init__()
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.hardtanh(x, min_val=self.min_val, max_val=self.max_val)


batch_size = 16384
dim = 32768
min_val = -1.5
max_val = 1.0

CPU_SIZES = {"batch_size": 64, "dim": 4096}


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [min_val, max_val]
