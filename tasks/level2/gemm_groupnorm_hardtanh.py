import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, group normalization over features, HardTanh."""

    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(num_groups, out_features)
        self.hardtanh = nn.Hardtanh(min_val=-2.0, max_val=2.0)

    def forward(self, x):
        x = self.linear(x)
        x = self.gn(x)
        x = self.hardtanh(x)
        return x


batch_size = 8192
in_features = 4096
out_features = 4096
num_groups = 32

CPU_SIZES = {"batch_size": 64, "in_features": 256, "out_features": 256, "num_groups": 8}


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
