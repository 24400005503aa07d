import torch
import torch.nn as nn


class Model(nn.Module):
    """Gated feed-forward block (SwiGLU) with RMS normalization and a residual connection."""

    def __init__(self, d_model, d_hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(d_model))
        self.w_gate = nn.Linear(d_model, d_hidden, bias=False)
        self.w_up = nn.Linear(d_model, d_hidden, bias=False)
        self.w_down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.norm_weight
        h = torch.nn.functional.silu(self.w_gate(h)) * self.w_up(h)
        return x + self.w_down(h)


batch_size = 8
seq_len = 1024
d_model = 1024
d_hidden = 2816

CPU_SIZES = {"batch_size": 2, "seq_len": 64, "d_model": 128, "d_hidden": 352}


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, d_hidden]
