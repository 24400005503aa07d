import torch
import torch.nn as nn


class Model(nn.Module):
    """Multi-head self-attention block: fused QKV projection, softmax attention, output
    projection, residual connection and post-layer normalization."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        assert d_model % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (self.head_dim ** -0.5)
        weights = torch.softmax(scores, dim=-1)
        attn = torch.matmul(weights, v)
        attn = attn.transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.proj(attn))


batch_size = 32
seq_len = 1024
d_model = 1024
num_heads = 16

CPU_SIZES = {"batch_size": 2, "seq_len": 64, "d_model": 128, "num_heads": 4}


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, num_heads]
