"""Direct convolution as the core of a fusion group: the ``conv`` knob's ``direct`` (issue #35).

On KernelBench's level-2 convolutions with few input channels (``Conv2d(8, 64, 3)`` at batch
128, 128x128: 57, 71, 82, 87 ...) the candidate's best was NCHW cuDNN + the epilogue kernel:
cuDNN writes the 520 MB output, the epilogue reads it and writes it again. The channels-last
cuDNN convolution (TF32) misses the 1e-4 tolerance there, the reference's NCHW one being exact
fp32 (``feedback.variant_order``). With ``K = C_in * prod(kernel)`` small the convolution is
cheap in fp32 FMAs (72 per output), so a generated kernel computes it directly - float32
FMAs, no TF32: as accurate as the reference - with the chain after it (bias, activations,
scalings) applied in registers before the one store (templates ``cuda_conv.cu.j2``,
``cpu_conv.cpp.j2``). A supported convolution is then a *core* of kind ``conv``, like a
reduction or a pool (``plan.py``): the chain before it is its prologue (applied to each input
element as it is staged; a padded position is a zero of the convolution's input, never
``f(0)``), the chain after it its epilogue.

Matched exactly where the kernels compute PyTorch's result: ``nn.Conv2d``/``nn.Conv3d`` (called
with the input alone) and ``F.conv2d``/``F.conv3d``/``torch.conv2d``/``torch.conv3d`` (a
weight and bias that are model parameters, ``get_attr`` nodes, as ``rewrites.split_conv_bias``
writes them) on a batched input, ``groups=1``, zeros padding given as integers (not
``'same'``/``'valid'`` strings), any stride, padding and dilation, with or without bias, and
``K <= MAX_K``. Anything else - grouped, transposed, reflect/replicate/circular padding, a
large ``K``, float64 - stays the library's call (cuDNN/oneDNN).

The ``conv`` knob decides (``library``: as before; ``direct``: these kernels), so measurement
picks; ``conv_tile`` shapes the CUDA kernel (``TILES``, ``SLIDE_TILES``). The direct convolution
is an NCHW path: the channels-last candidate (``layout=nhwc``) keeps cuDNN. On ``cuda`` it is on
unless ``KERNELLOOP_CUDA_CONV=0`` (judged on GPUs since session q, ``scripts/gpu_conv_check.py``);
on the CPU it is on (judged in CI).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from agent.builtin.dtypes import supported as dtype_supported, value_dtype
from agent.builtin.ops import ModuleAttr, OpInfo, shape_of

CONV_MODES = ("library", "direct")
CUDA_CONV_ENV = "KERNELLOOP_CUDA_CONV"
MAX_K = {2: 128, 3: 128}            # C_in * prod(kernel) at most this: fp32 FMAs beat cuDNN's traffic
# conv_tile -> (output rows per thread, output channels per thread, warps along the rows): a block
# is 32 output columns (one warp, consecutive x: coalesced stores) x rows_per_thread * warp_rows
# rows x channels_per_thread * channel groups channels, about 256 threads
TILES = {"4x16": (4, 16, 2), "2x16": (2, 16, 4), "4x8": (4, 8, 4), "8x8": (8, 8, 2)}
# c8x8 (a register-blocked tile, below): on one H100 (session ah, gpu_conv_check, 8 level-2 2-D tasks)
# geomean 0.959x compile against 4x8's 0.936x (before: 4x8, fastest on 15 of 17 tasks on an H200, session q)
DEFAULT_TILE = "c8x8"
THREADS = 256
MAX_SHARED_BYTES = 160 * 1024      # staged input tile + weights (dynamic shared memory, sm_80+)
# The tensor-core tile: the same convolution as an implicit GEMM on TF32 mma.sync (m16n8k8) in three
# products per step (3xTF32: each float32 operand split into a TF32 value and its TF32 remainder,
# big*big + big*small + small*big), accurate to float32 rounding as the FMA kernels are. Each warp
# computes one output row of 32 columns (two 16-row m-tiles) for up to MMA_COB output channels.
# The FMA tiles run at about a third of the fp32 FMA peak (session s). On an H200 (session u) this one
# was correct on 17 level-2 tasks but slower overall (geomean 0.917x compile against 4x8's 0.970x), so
# it stays off unless KERNELLOOP_CUDA_CONV_3XTF32=1 (docs/builtin_conv.md).
# The register-blocked tiles: a thread keeps `px` consecutive output columns x 8 channels (a warp 32
# columns x 256 / px / 8 rows of one channel group, a block up to 8 channel groups: 64 channels): per
# input channel and kernel row one run of vector loads of the thread's input values serves every
# kernel column, a GEMM's blocking rather than one column per lane (docs/builtin_conv.md). They need
# stride and dilation 1 along x (the columns consecutive in the staged row); elsewhere the FMA tile
# FALLBACK_TILE. c8x8: 64 accumulators, 128 registers (two blocks an SM); c4x8: 32, three blocks.
SLIDE_TILES = {"c8x8": 8, "c4x8": 4}
SLIDE_MIN_BLOCKS = {8: 2, 4: 3}    # blocks an SM the registers are bounded for (128 and 85: no spill on sm_90a)
TRANSPOSE_STRIDE = 36              # floats a row of a warp's transpose area (32 + 4: no bank conflicts)
FALLBACK_TILE = "4x8"
MMA_TILE = "3xtf32"
MMA_ENV = "KERNELLOOP_CUDA_CONV_3XTF32"
MMA_ROWS = 8                       # warps per block, one output row each
MMA_COB = 64                       # output channels per block at most (a multiple of 8)


def mma_on() -> bool:
    """Whether the tensor-core tile is among the ``conv_tile`` values tried (``KERNELLOOP_CUDA_CONV_3XTF32=1``)."""
    return os.environ.get(MMA_ENV, "0") == "1"


def tile_names() -> list[str]:
    """The ``conv_tile`` values the search tries: the FMA tiles, and the tensor-core one where on."""
    return list(TILES) + list(SLIDE_TILES) + ([MMA_TILE] if mma_on() else [])

_MODULES = {nn.Conv2d: 2, nn.Conv3d: 3}
_FUNCTIONS = {F.conv2d: 2, torch.conv2d: 2, F.conv3d: 3, torch.conv3d: 3}


def direct_on(device: str) -> bool:
    """Whether supported convolutions may run in the generated kernels on ``device``: yes, unless
    ``device`` is ``cuda`` and ``KERNELLOOP_CUDA_CONV=0``. The CUDA kernels were judged on an H200
    in session q (``scripts/gpu_conv_check.py``, 17 level-2 tasks: every output within float32
    rounding); the CPU kernels are judged in CI. A direct convolution is a variant (``conv``
    knob): measurement decides whether it is kept."""
    return device != "cuda" or os.environ.get(CUDA_CONV_ENV, "1") != "0"


def _tuple(v: Any, dims: int) -> Optional[tuple[int, ...]]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * dims
    if isinstance(v, (tuple, list)) and len(v) == 1 and isinstance(v[0], int):
        return (int(v[0]),) * dims
    if isinstance(v, (tuple, list)) and len(v) == dims and all(isinstance(a, int) and not isinstance(a, bool) for a in v):
        return tuple(int(a) for a in v)
    return None


def tile_shape(tile: str, out_channels: int, kernel_width: int = 1) -> dict[str, Any]:
    """The CUDA block of ``tile`` for ``out_channels``: rows/channels per thread, warp rows,
    channel groups (fewer where the convolution has fewer channels), the block's tile sizes.
    The tensor-core tile (``mma``): one output row per warp, ``cob`` channels in n-tiles of 8,
    the weights staged with a row stride of ``cob + 8`` (B fragments' loads without bank conflicts).
    A register-blocked tile (``slide``): ``px`` columns a thread, ``lanes_x`` threads along a row,
    ``nv`` float4 loads and ``iwp`` floats a staged input row for a kernel ``kernel_width`` wide."""
    if tile == MMA_TILE:
        cob = min(MMA_COB, -(-out_channels // 8) * 8)
        return {"mma": True, "slide": False, "py": 1, "ct": cob, "wy": MMA_ROWS, "cg": 1, "th": MMA_ROWS, "tw": 32, "cob": cob,
                "nt": cob // 8, "ws": cob + 8, "threads": 32 * MMA_ROWS}
    if tile in SLIDE_TILES:
        px = SLIDE_TILES[tile]
        cg = max(1, min(-(-out_channels // 8), THREADS // 32))
        return {"mma": False, "slide": True, "px": px, "ct": 8, "cg": cg, "th": 32 // (32 // px), "tw": 32,
                "lanes_x": 32 // px, "min_blocks": SLIDE_MIN_BLOCKS[px], "cob": cg * 8, "threads": 32 * cg, "tws": TRANSPOSE_STRIDE,
                "nv": slide_loads(px, kernel_width), "iwp": slide_row_floats(px, kernel_width)}
    py, ct, wy = TILES[tile]
    cg = max(1, min(-(-out_channels // ct), THREADS // (32 * wy)))
    return {"mma": False, "slide": False, "py": py, "ct": ct, "wy": wy, "cg": cg, "th": py * wy, "tw": 32, "cob": cg * ct,
            "threads": 32 * wy * cg}


def shared_floats(params: dict[str, Any], tile: str) -> tuple[int, int]:
    """(input tile, weights) floats a block of ``tile`` stages in shared memory; the tensor-core
    tile stages each twice (TF32 values and remainders), the weights over ``k`` rounded up to 8,
    and the input's offset per ``k`` (one int each)."""
    kd, kh, kw = params["kernel3"]
    t = tile_shape(tile, params["out_channels"], kw)
    _, sh, sw = params["stride3"]
    _, dh, dw = params["dilation3"]
    ih = (t["th"] - 1) * sh + (kh - 1) * dh + 1
    iw = (t["tw"] - 1) * sw + (kw - 1) * dw + 1
    s_in = params["in_channels"] * kd * ih * iw
    if t.get("slide"):
        # two tiles' input (one computed while the next is staged), rows padded to whole float4s
        # past the last thread's vector loads; each also the warps' transpose areas once its
        # products are done
        return 2 * max(params["in_channels"] * kd * ih * t["iwp"], t["cg"] * t["th"] * t["tws"]), params["k"] * t["cob"]
    if t["mma"]:
        k8 = -(-params["k"] // 8) * 8
        return (2 * s_in + k8 + 3) // 4 * 4, 2 * k8 * t["ws"]
    return (s_in + 3) // 4 * 4, params["k"] * t["cob"]


def slide_loads(px: int, kw: int) -> int:
    """float4 loads of a staged input row per thread of a register-blocked tile (its ``px`` columns
    and the kernel's width less one)."""
    return -(-(px + kw - 1) // 4)


def slide_row_floats(px: int, kw: int) -> int:
    """A staged input row of a register-blocked tile: its 32 + kw - 1 values, at least as far as
    the last thread's vector loads reach, rounded up to whole float4s."""
    return max(-(-(32 + kw - 1) // 4) * 4, 32 - px + 4 * slide_loads(px, kw))


def rendered_tile(params: dict[str, Any], tile: str, tail: bool = False) -> str:
    """The tile a kernel is written with: ``tile``; ``FALLBACK_TILE`` (an FMA tile: a matched
    convolution fits every one) where the tensor-core tile's staging (each operand twice) or a
    register-blocked tile's (two tiles' input) would not fit ``MAX_SHARED_BYTES``, where a
    register-blocked tile is asked for a stride or dilation along x (its columns are consecutive),
    and where the group ends in a tail reduction or sums a batch norm's statistics (``tail``;
    conv_stats.py), which the tensor-core tile does not accumulate."""
    if tile == MMA_TILE and (tail or sum(shared_floats(params, tile)) * 4 > MAX_SHARED_BYTES):
        return FALLBACK_TILE
    if tile in SLIDE_TILES and (params["stride3"][2] != 1 or params["dilation3"][2] != 1
                               or sum(shared_floats(params, tile)) * 4 > MAX_SHARED_BYTES):
        return FALLBACK_TILE
    return tile


def _parameter(node: Any, modules: dict[str, nn.Module]) -> Any:
    """A ``get_attr`` node of a model parameter as itself (None: absent); anything else: False."""
    if node is None:
        return None
    if isinstance(node, Node) and node.op == "get_attr" and shape_of(node) is not None:
        return node
    return False


def _call(node: Node, modules: dict[str, nn.Module]) -> Optional[tuple[int, Any, Any, Any, dict[str, Any]]]:
    """(dims, input, weight, bias, parameters) of a convolution call (None: not one we match)."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        dims = _MODULES.get(type(mod))
        if dims is None or len(node.args) != 1 or node.kwargs or mod.padding_mode != "zeros":
            return None
        path = str(node.target)
        w = ModuleAttr(path, "weight", tuple(mod.weight.shape), mod.weight.dtype)
        b = None if mod.bias is None else ModuleAttr(path, "bias", tuple(mod.bias.shape), mod.bias.dtype)
        return dims, node.args[0], w, b, {"stride": mod.stride, "padding": mod.padding,
                                          "dilation": mod.dilation, "groups": mod.groups}
    if node.op != "call_function" or node.target not in _FUNCTIONS:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    vals: dict[str, Any] = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    if len(node.args) > len(names):
        return None
    vals.update(zip(names, node.args))
    for k, v in node.kwargs.items():
        if k not in names:
            return None
        vals[k] = v
    w, b = _parameter(vals.get("weight"), modules), _parameter(vals["bias"], modules)
    if not w or b is False:
        return None
    return _FUNCTIONS[node.target], vals.get("input"), w, b, vals


def conv_info(node: Node, modules: dict[str, nn.Module], device: str) -> Optional[OpInfo]:
    """The ``conv`` core of a supported convolution node (None: the library's, also wherever
    ``direct_on(device)`` is not)."""
    if not direct_on(device):
        return None
    call = _call(node, modules)
    if call is None:
        return None
    dims, x, w, b, p = call
    xs, ws, os_ = shape_of(x) if isinstance(x, Node) else None, tuple(w.shape) if isinstance(w, ModuleAttr) else shape_of(w), shape_of(node)
    if xs is None or ws is None or os_ is None or len(xs) != dims + 2 or len(ws) != dims + 2 or len(os_) != dims + 2:
        return None
    stride, padding, dilation = (_tuple(p[k], dims) for k in ("stride", "padding", "dilation"))
    if p["groups"] != 1 or stride is None or padding is None or dilation is None:
        return None
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or ws[1] != xs[1]:
        return None
    k = ws[1]
    for s in ws[2:]:
        k *= s
    if k > MAX_K[dims] or min(os_[2:]) < 1:
        return None
    for v in (x, w, b, node):
        if v is not None and not dtype_supported(value_dtype(v)):
            return None
    pad3 = (lambda t, one: (one,) * (3 - dims) + tuple(t))
    params = {"dims": dims, "in_channels": int(ws[1]), "out_channels": int(ws[0]), "k": int(k),
              "kernel": tuple(ws[2:]), "stride": stride, "padding": padding, "dilation": dilation,
              "kernel3": pad3(ws[2:], 1), "stride3": pad3(stride, 1), "padding3": pad3(padding, 0),
              "dilation3": pad3(dilation, 1), "bias": b is not None}
    if max(sum(shared_floats(params, t)) for t in TILES) * 4 > MAX_SHARED_BYTES:
        return None
    return OpInfo("conv", f"conv{dims}d", [x, w] + ([b] if b is not None else []), params)


def with_direct_convs(gm_nodes: list[Node], infos: dict[Node, OpInfo], modules: dict[str, nn.Module],
                      device: str) -> dict[Node, OpInfo]:
    """``infos`` with every supported convolution (a ``library`` node) as a ``conv`` core: the
    plan's classification under ``conv=direct``."""
    out = dict(infos)
    for n in gm_nodes:
        if infos[n].kind != "library":
            continue
        info = conv_info(n, modules, device)
        if info is None:
            continue
        x = info.operands[0]
        while isinstance(x, Node) and infos[x].kind == "alias" and isinstance(infos[x].operands[0], Node):
            x = infos[x].operands[0]          # through identities, as classify_graph resolves them
        out[n] = replace(info, operands=[x, *info.operands[1:]])
    return out


def emulate(info: OpInfo, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """What the kernel computes, for the replay's plan mode (float64 operands)."""
    p = info.params
    fn = F.conv2d if p["dims"] == 2 else F.conv3d
    return fn(x, w, b, p["stride"], p["padding"], p["dilation"])
