import torch
import torch.nn as nn


class Model(nn.Module):
    """Multi-layer perceptron: Linear/ReLU blocks ending in a Linear output layer."""

    def __init__(self, input_size, layer_sizes, output_size):
        super().__init__()
        layers = []
        current = input_size
        for size in layer_sizes:
            layers.append(nn.Linear(current, size))
            layers.append(nn.ReLU())
            current = size
        layers.append(nn.Linear(current, output_size))
        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


batch_size = 8192
input_size = 4096
hidden_size = 4096
num_hidden_layers = 2
output_size = 1024

CPU_SIZES = {"batch_size": 64, "input_size": 256, "hidden_size": 256, "output_size": 64}


def get_inputs():
    return [torch.randn(batch_size, input_size)]


def get_init_inputs():
    return [input_size, [hidden_size] * num_hidden_layers, output_size]
