# A small elementwise task for the Triton backend's CPU tests (interpreter-sized).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return torch.relu(x + y) * self.scale


n = 4096
scale = 1.5


def get_inputs():
    return [torch.randn(n), torch.randn(n)]


def get_init_inputs():
    return [scale]
