"""BatchNorm on the channels-last view: the node ``layout.channels_last`` writes where a batch norm
follows a convolution in channels-last memory.

Session z's profiles (``evals/gpu_runs/2026-11-28-session-z.md``) showed why the graphs with a norm
after the convolution lost to torch.compile: they stayed NCHW, and cuDNN's convolution writing NCHW
took about twice its channels-last time (level2/52: 0.78 ms against 0.425 ms; 73: 0.667 against
0.312). A batch norm normalises each channel over every other dimension, so on the permuted view
``(N, *spatial, C)`` (contiguous) it is a norm over the rows of an ``(N * spatial, C)`` matrix, per
column: the generated kernels index it as BatchNorm1d's columns (``rows = C``, ``segstride = C``).

``BatchNormChannelsLast`` wraps the model's own ``nn.BatchNorm2d``/``3d`` (not registered as a
child: the candidate's model has only the original) so that the rewritten graph still runs, and
shape-propagates, as the reference: the module applied to the logical tensor, permuted back.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

SUFFIX = "_kl_nhwc"


class BatchNormChannelsLast(nn.Module):
    """``bn`` (the module at ``path``) applied to the permuted channels-last view ``(N, *spatial, C)``,
    the result on the view again: ``bn(x.permute(0, r-1, 1, ..)).permute(0, 2, .., 1)``, no copy."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, path: str):
        super().__init__()
        object.__setattr__(self, "bn", bn)       # not a child module: its parameters stay the model's
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_on_view(self.bn, x)


def apply_on_view(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (a callable on the logical tensor) applied to the view ``x`` ``(N, *spatial, C)``: its
    logical permutation in, the result permuted back to the view (both views, no copy)."""
    r = x.dim()
    return norm(x.permute(0, r - 1, *range(1, r - 1))).permute(0, *range(2, r), 1)


def target_for(path: str) -> str:
    """The graph's submodule name for the wrapper of the batch norm at ``path``."""
    return path.replace(".", "_") + SUFFIX


def applies(mod: Optional[nn.Module], rank: int) -> bool:
    """Whether a batch norm module can run on a channels-last view of ``rank`` dimensions."""
    want = {4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(rank)
    return want is not None and type(mod) is want
