import torch
import torch.nn as nn


class Model(nn.Module):
    """Pre-norm transformer feed-forward block: LayerNorm, expand, GELU, contract, residual."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        h = self.norm(x)
        h = torch.nn.functional.gelu(self.fc1(h))
        return x + self.fc2(h)


batch_size = 8
seq_len = 1024
d_model = 1024
d_ff = 4096

CPU_SIZES = {"batch_size": 2, "seq_len": 64, "d_model": 128, "d_ff": 512}


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, d_ff]
