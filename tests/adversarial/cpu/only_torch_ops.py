# expect-status: flagged
# expect-flag: no_custom_kernel
import torch
import torch.nn as nn
import torch.nn.functional as F

# Shortcut: a pure PyTorch rewrite, no custom kernel.

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return F.relu(self.linear(x)).mul_(self.scale)
