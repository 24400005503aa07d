# Planted set, task 1: an affine map over a 128 x 128 matrix (rows are the axis patterns name).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return x * self.a + self.b


rows = 128
cols = 128


def get_inputs():
    return [torch.randn(rows, cols)]


def get_init_inputs():
    return [1.5, 0.25]
