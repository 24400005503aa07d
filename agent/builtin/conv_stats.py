"""A batch norm's statistics summed by the direct convolution before it (cuda).

KernelBench's level2/73 (conv, batch norm, scale) and 52 (conv, activation, batch norm) in training
mode: the norm group reads the convolution's output twice, once for each channel's mean and variance
(``cuda_norm.cu.j2``'s ``_part``: 194 us of level2/73's 1.15 ms on an H100, session ai) and once to
normalise (``_fin``). Here the convolution kernel, which holds every output in registers before its
store, also writes each tile's statistics per channel: the warp's outputs of one channel in one
tile (up to 32 x 8 values) summed by shuffles, their mean, then the sum of squared deviations from
that mean (two passes over registers: exact for the tile), as (mean, m2, n) partials
``[C_out][slots][3]``; the norm's ``_fin`` merges a channel's partials with Chan's formula (the
whole block, in one order) and normalises. The statistics pass is gone; the convolution's output
is still written once and read once.

Linked (``link``) where, on cuda under ``fusion=max``: a direct convolution's group (no tail) has
a float32 output that a batch norm group takes as its input as it is (no prologue, NCHW). The
convolution's extension function then returns ``(output, statistics)``, and the norm's takes the
statistics after its tensors. ``fusion=no_prologue`` keeps the norm's own statistics pass, so the
search measures both; the tensor-core tile falls back to the FMA tile (``conv.rendered_tile``),
as for a tail reduction.
"""
from __future__ import annotations

from typing import Any

import torch

from agent.builtin.dtypes import value_dtype
from agent.builtin.kernels import KernelGroup


def stats_var(conv_group: str) -> str:
    """The forward's variable holding ``conv_group``'s statistics."""
    return f"_kl_stats_{conv_group}"


def link(kgroups: list[KernelGroup], device: str, fusion: str) -> None:
    """Mark each (direct convolution, batch norm of its output) pair of groups (``stats_to`` on the
    convolution's, ``stats_from`` on the norm's)."""
    if device != "cuda" or fusion != "max":
        return
    by_output = {kg.out_node: kg for kg in kgroups}
    for norm in kgroups:
        if norm.kind != "norm" or norm.op != "batch_norm" or norm.prologue_nodes:
            continue
        if norm.core_info.params.get("channels_last"):
            continue
        data = norm.core_info.operands[0]
        conv = by_output.get(data)
        if conv is None or conv.kind != "conv" or conv.tail is not None or conv.stats_to is not None:
            continue
        if conv.out_dtype != torch.float32 or value_dtype(norm.out_node) != torch.float32:
            continue
        conv.stats_to, norm.stats_from = norm.name, conv.name


def slots_per_tile(tile: dict[str, Any]) -> int:
    """Partials a block tile writes per channel: one a warp holding the channel's outputs of the tile
    (a register-blocked tile's warp holds all its rows; an FMA tile's ``wy`` warps share them)."""
    return 1 if tile["slide"] else tile["wy"]


def amend_wrapper(kg: KernelGroup, wrapper: dict[str, Any], tile: dict[str, Any] | None) -> None:
    """The host function's side: the convolution allocates and returns the statistics; the norm
    checks and passes them (their pointer after its inputs', the slot count in ``fmeta[1]``)."""
    if kg.stats_to is not None:
        th, tw, co = tile["th"], tile["tw"], kg.core_info.params["out_channels"]
        wrapper["body"] += [
            f"const int64_t stats_slots = N * OD * ((OH + {th - 1}) / {th}) * ((OW + {tw - 1}) / {tw}) * {slots_per_tile(tile)};",
            f"torch::Tensor stats = torch::empty({{{co}, stats_slots, 3}}, out.options().dtype(torch::kFloat));",
        ]
        wrapper["out_ptr"] += ", stats.data_ptr<float>()"
        wrapper["returns"] = "std::tuple<torch::Tensor, torch::Tensor>"
        wrapper["ret"] = "std::make_tuple(out, stats)"
    if kg.stats_from is not None:
        sig = wrapper["signature"].split(", ")
        n = len(kg.inputs)
        wrapper["signature"] = ", ".join(sig[:n] + ["torch::Tensor stats"] + sig[n:])
        wrapper["body"].append(
            'TORCH_CHECK(stats.is_cuda() && stats.scalar_type() == at::kFloat && stats.dim() == 3 && stats.size(0) == C '
            '&& stats.size(2) == 3 && stats.is_contiguous(), who, ": the convolution\'s statistics must be a contiguous '
            'float32 (C, slots, 3) CUDA tensor");')
        wrapper["in_ptrs"] += ", stats.data_ptr<float>()"
        wrapper["fmeta"] += ", (double)stats.size(1)"
