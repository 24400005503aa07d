import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, layer normalization over features, GELU."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = nn.LayerNorm(out_features)

    def forward(self, x):
        x = self.linear(x)
        x = self.norm(x)
        x = torch.nn.functional.gelu(x)
        return x


batch_size = 8192
in_features = 4096
out_features = 4096

CPU_SIZES = {"batch_size": 64, "in_features": 256, "out_features": 256}


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
