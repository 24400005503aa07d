import torch
import torch.nn as nn


class Model(nn.Module):
    """ResNet basic block: two 3x3 conv/batch-norm layers with an identity shortcut."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + identity)


batch_size = 64
channels = 64
height = 128
width = 128

CPU_SIZES = {"batch_size": 2, "channels": 8, "height": 24, "width": 24}


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels]
