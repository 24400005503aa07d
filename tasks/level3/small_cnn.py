import torch
import torch.nn as nn


class Model(nn.Module):
    """Small image classifier: three conv/ReLU/max-pool stages and a linear head."""

    def __init__(self, in_channels, image_size, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        reduced = image_size // 8
        self.classifier = nn.Linear(128 * reduced * reduced, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


batch_size = 256
in_channels = 3
image_size = 128
num_classes = 100

CPU_SIZES = {"batch_size": 4, "image_size": 32}


def get_inputs():
    return [torch.randn(batch_size, in_channels, image_size, image_size)]


def get_init_inputs():
    return [in_channels, image_size, num_classes]
