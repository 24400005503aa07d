"""Norms on the channels-last view: the node ``layout.channels_last`` writes where a batch, group or
instance norm follows a convolution in channels-last memory.

Session z's profiles (``evals/gpu_runs/2026-11-28-session-z.md``) showed why the graphs with a norm
after the convolution lost to torch.compile: they stayed NCHW, and cuDNN's convolution writing NCHW
took about twice its channels-last time (level2/52: 0.78 ms against 0.425 ms; 73: 0.667 against
0.312). A batch norm normalises each channel over every other dimension, so on the permuted view
``(N, *spatial, C)`` (contiguous) it is a norm over the rows of an ``(N * spatial, C)`` matrix, per
column: the generated kernels index it as BatchNorm1d's columns (``rows = C``, ``segstride = C``).
An instance norm is the same per sample (columns ``(n, c)`` of each sample's ``(spatial, C)``
matrix), and a group norm merges the statistics of its group's ``C / G`` adjacent columns: on CUDA
the column kernels do it across the lanes of a warp, so a group's channels must be a power of two of
at most 32 (the groups of a 32-column tile then never straddle it); ``applies`` says which.

``NormChannelsLast`` wraps the model's own norm module (not registered as a child: the candidate's
model has only the original) so that the rewritten graph still runs, and shape-propagates, as the
reference: the module applied to the logical tensor, permuted back.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

SUFFIX = "_kl_nhwc"


class NormChannelsLast(nn.Module):
    """``norm`` (the module at ``path``) applied to the permuted channels-last view ``(N, *spatial, C)``,
    the result on the view again: ``norm(x.permute(0, r-1, 1, ..)).permute(0, 2, .., 1)`` (a group or
    instance norm through contiguous copies: ``apply_on_view``)."""

    def __init__(self, norm: nn.Module, path: str):
        super().__init__()
        object.__setattr__(self, "norm", norm)   # not a child module: its parameters stay the model's
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_on_view(self.norm, x, copies_for(self.norm))


def apply_on_view(norm, x: torch.Tensor, copies: bool) -> torch.Tensor:
    """``norm`` (a callable on the logical tensor) applied to the view ``x`` ``(N, *spatial, C)``: its
    logical permutation in, the result permuted back to the view (both views, no copy). With
    ``copies`` (a group or instance norm: ``copies_for``) the input goes in contiguous (logical)
    memory and the result comes back contiguous on the view: PyTorch's CPU group norm of a
    channels-last tensor measured 1e-3 off a float64 run where the contiguous one is 3e-6 off."""
    r = x.dim()
    to_logical, to_view = (0, r - 1, *range(1, r - 1)), (0, *range(2, r), 1)
    if not copies:
        return norm(x.permute(*to_logical)).permute(*to_view)
    return norm(x.permute(*to_logical).contiguous()).permute(*to_view).contiguous()


def copies_for(norm: nn.Module) -> bool:
    """Whether ``apply_on_view`` copies for this norm module: all but a batch norm."""
    return not isinstance(norm, nn.modules.batchnorm._BatchNorm)


def target_for(path: str) -> str:
    """The graph's submodule name for the wrapper of the norm at ``path``."""
    return path.replace(".", "_") + SUFFIX


def applies(mod: Optional[nn.Module], rank: int) -> bool:
    """Whether a norm module can run on a channels-last view of ``rank`` dimensions: a batch norm, an
    instance norm without running statistics, or a group norm of at most 32 channels a group, a power
    of two."""
    if rank not in (4, 5):
        return False
    if type(mod) is {4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[rank]:
        return True
    if type(mod) is {4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[rank]:
        return not mod.track_running_stats
    if type(mod) is nn.GroupNorm:
        cpg = mod.num_channels // mod.num_groups
        return 1 <= cpg <= 32 and cpg & (cpg - 1) == 0
    return False
