# expect-status: flagged
# expect-flag: fallback
import torch
import torch.nn as nn

# Shortcut: carry the reference Model along and call it.

class Model(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.linear(x)) * self.scale


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.ref = Model(in_features, out_features, scale)

    def forward(self, x):
        return self.ref(x)
