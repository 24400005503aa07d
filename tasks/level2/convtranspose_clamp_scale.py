import torch
import torch.nn as nn


class Model(nn.Module):
    """Transposed convolution (2x upsampling), add bias, clamp to [0, 1], scale."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias_shape, scaling_factor):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size,
                                                 stride=stride, padding=padding)
        self.bias = nn.Parameter(torch.randn(bias_shape) * 0.1)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.conv_transpose(x)
        x = x + self.bias
        x = torch.clamp(x, min=0.0, max=1.0)
        x = x * self.scaling_factor
        return x


batch_size = 64
in_channels = 128
out_channels = 64
height = width = 64
kernel_size = 4
stride = 2
padding = 1
scaling_factor = 3.0

CPU_SIZES = {"batch_size": 2, "in_channels": 16, "out_channels": 8, "height": 12, "width": 12}


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding, (out_channels, 1, 1), scaling_factor]
