# Planted set, task 3: the affine map plus a fixed 20 ms of waiting that stands for work a
# candidate may do in less (or more) time. Waiting, unlike arithmetic, takes the same time on a
# busy 2-core machine, so the planted speedups are what they claim to be.
import time

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        time.sleep(0.020)
        return x * self.a + self.b


def get_inputs():
    return [torch.randn(64, 64)]


def get_init_inputs():
    return [1.5, 0.25]
