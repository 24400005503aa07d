# Planted set, task 2: the same affine map over an (N, C, H, W) activation.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return x * self.a + self.b


def get_inputs():
    return [torch.randn(2, 16, 24, 24)]


def get_init_inputs():
    return [1.5, 0.25]
