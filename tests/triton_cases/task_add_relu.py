# The prompt's worked example's task: relu(a + b), no constructor arguments.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.relu(a + b)


def get_inputs():
    return [torch.randn(8, 1000), torch.randn(8, 1000)]


def get_init_inputs():
    return []
