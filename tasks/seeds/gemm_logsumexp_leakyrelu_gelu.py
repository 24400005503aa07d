import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, logsumexp over features (kept as a column), two LeakyReLUs and two GELUs."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        x = self.linear(x)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.nn.functional.leaky_relu(x, negative_slope=0.01)
        x = torch.nn.functional.leaky_relu(x, negative_slope=0.01)
        x = torch.nn.functional.gelu(x)
        x = torch.nn.functional.gelu(x)
        return x


batch_size = 16384
in_features = 4096
out_features = 512

CPU_SIZES = {"batch_size": 128, "in_features": 512, "out_features": 512}


def get_inputs():
    return [torch.randn(batch_size, in_features) * 4.0]


def get_init_inputs():
    return [in_features, out_features]
