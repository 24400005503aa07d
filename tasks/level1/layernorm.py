import torch
import torch.nn as nn


class Model(nn.Module):
    """Layer normalization over the hidden dimension of a (batch, seq, hidden) tensor."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


batch_size = 64
seq_len = 4096
hidden = 2048

CPU_SIZES = {"batch_size": 4, "seq_len": 64, "hidden": 256}


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden) * 2.0 + 0.5]


def get_init_inputs():
    return [hidden]
