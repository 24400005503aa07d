"""2-D and 3-D max and average pooling as the core of a fusion group (issue #35).

KernelBench's level-2 convolution tasks pool between two elementwise chains
(``conv -> sub -> hardswish -> max_pool2d -> mish``). With pooling on the library the
candidate writes the whole convolution-sized tensor after the first chain, the library reads
it back and writes a quarter, and a third kernel runs the second chain; torch.compile
(inductor) reads the convolution's output once. Here a supported pooling node is classified
``pool``, a core like a reduction (``plan.py``): the chain before it is its prologue, applied
to each input element as the window reads it, and the chain after it its epilogue, applied
to each pooled value before the one store (templates ``cuda_pool.cu.j2``, ``cpu_pool.cpp.j2``).

Matched exactly where the kernels compute PyTorch's result: ``F.max_pool2d``,
``torch.max_pool2d``, ``nn.MaxPool2d``, ``F.avg_pool2d``, ``nn.AvgPool2d`` on a batched
(4-d) input, and their 3-D forms (``max_pool3d``, ``avg_pool3d``: level2's ConvTranspose3d tasks
pool between chains too) on a batched 5-d input, with dilation 1, ``ceil_mode=False``, no
indices returned, padding at most half the kernel, and for average pooling
``count_include_pad=True`` and no ``divisor_override``.
Anything else stays the library's call. Semantics (float32 accumulation, the half types
loaded and stored as ``dtypes`` says):

* max: padded positions never win (the window skips them; the accumulator starts at -inf);
  a NaN anywhere in the window makes the result NaN, as PyTorch's CPU and CUDA kernels do
  (``val > maxval || isnan(val)``);
* avg: the sum over the window's real elements divided by the kernel's area: a padded
  position counts as a zero of the pool's *input*, i.e. after the prologue (never ``f(0)``).
  With ``ceil_mode=False`` no window reaches past the padding, so PyTorch's divisor is the
  area too.

The ``layout`` knob's channels-last rewrite (``layout.py``) puts a supported pool on the
permuted view ``(N, H, W, C)`` (``(N, D, H, W, C)``) as ``pool_nhwc``, so the kernel reads the convolution's
channels-last output in its memory order. Whether the pool is fused is the ``fusion`` knob's
choice: ``max``/``no_prologue``/``split`` run it as a kernel, ``elementwise`` (like the
reductions and norms) leaves it to the library, so measurement compares the two.
"""
from __future__ import annotations

import os

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from agent.builtin.ops import OpInfo, shape_of


_FN = {"max_pool2d": F.max_pool2d, "avg_pool2d": F.avg_pool2d, "max_pool3d": F.max_pool3d, "avg_pool3d": F.avg_pool3d}


def _to_logical(rank: int) -> tuple[int, ...]:
    return (0, rank - 1, *range(1, rank - 1))


def _to_view(rank: int) -> tuple[int, ...]:
    return (0, *range(2, rank), 1)


def pool_nhwc(x: torch.Tensor, op: str, kernel: tuple, stride: tuple, padding: tuple) -> torch.Tensor:
    """Pooling of the permuted channels-last view ``(N, H, W, C)`` (``(N, D, H, W, C)``), as a view
    ``(N, OH, OW, C)`` (``(N, OD, OH, OW, C)``): the graph node ``layout.channels_last`` writes for a
    supported pool (on PyTorch: the pool of the logical tensor, permuted back; no copy)."""
    r = x.dim()
    return _FN[op](x.permute(*_to_logical(r)), kernel, stride, padding).permute(*_to_view(r))


def _ntuple(v: Any, n: int) -> Optional[tuple[int, ...]]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    if isinstance(v, (tuple, list)) and len(v) == 1 and isinstance(v[0], int):
        return (v[0],) * n
    if isinstance(v, (tuple, list)) and len(v) == n and all(isinstance(a, int) and not isinstance(a, bool) for a in v):
        return tuple(int(a) for a in v)
    return None


# the functional forms' parameters after the input, in order, with PyTorch's defaults
_MAX_PARAMS = (("kernel_size", None), ("stride", None), ("padding", 0), ("dilation", 1),
               ("ceil_mode", False), ("return_indices", False))
_AVG_PARAMS = (("kernel_size", None), ("stride", None), ("padding", 0), ("ceil_mode", False),
               ("count_include_pad", True), ("divisor_override", None))
_FUNCTIONS = {F.max_pool2d: ("max_pool2d", _MAX_PARAMS), torch.max_pool2d: ("max_pool2d", _MAX_PARAMS),
              F.avg_pool2d: ("avg_pool2d", _AVG_PARAMS), F.max_pool3d: ("max_pool3d", _MAX_PARAMS),
              torch.max_pool3d: ("max_pool3d", _MAX_PARAMS), F.avg_pool3d: ("avg_pool3d", _AVG_PARAMS)}
_MODULES = {nn.MaxPool2d: "max_pool2d", nn.AvgPool2d: "avg_pool2d", nn.MaxPool3d: "max_pool3d",
            nn.AvgPool3d: "avg_pool3d"}


def _call(node: Node, modules: dict[str, nn.Module]) -> Optional[tuple[str, Any, dict[str, Any]]]:
    """(op, input, parameters) of a pooling call, whatever form it was written in (None: not one)."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        op = _MODULES.get(type(mod))
        if op is None or len(node.args) != 1 or node.kwargs:
            return None
        names = [n for n, _ in (_MAX_PARAMS if op.startswith("max") else _AVG_PARAMS)]
        return op, node.args[0], {n: getattr(mod, n) for n in names}
    if node.op != "call_function" or node.target not in _FUNCTIONS:
        return None
    op, spec = _FUNCTIONS[node.target]
    args = list(node.args)
    kwargs = dict(node.kwargs)
    x = args.pop(0) if args else kwargs.pop("input", None)
    params = {name: default for name, default in spec}
    for (name, _), value in zip(spec, args):
        params[name] = value
    for name, value in kwargs.items():
        if name not in params:
            return None
        params[name] = value
    return op, x, params


CUDA_POOL_ENV = "KERNELLOOP_CUDA_POOL"


def fused_on(device: str) -> bool:
    """Whether pooling runs in the generated kernels on ``device``: yes, unless ``device`` is
    ``cuda`` and ``KERNELLOOP_CUDA_POOL=0``. The CUDA kernels were judged on an H200 in session q
    (``scripts/gpu_pool_check.py``: every output within float32 rounding of the reference, fused
    faster than the library's pooling on every case), the 3-D ones in session ac (the GPU tests, and
    every candidate of the nine level-2 tasks with 3-D pools judged there correct); the CPU
    kernels are judged in CI."""
    return device != "cuda" or os.environ.get(CUDA_POOL_ENV, "1") != "0"


def pool_info(node: Node, modules: dict[str, nn.Module], device: str) -> Optional[OpInfo]:
    """The ``pool`` core of a supported 2-D or 3-D max/avg pooling node (None: the library's call,
    also wherever ``fused_on(device)`` is not). Its kernel, stride and padding have one entry per
    pooled dimension (two or three)."""
    if not fused_on(device):
        return None
    if node.op == "call_function" and node.target is pool_nhwc:
        x, op, k, s, p = node.args
        return OpInfo("pool", op, [x], {"kernel": k, "stride": s, "padding": p, "layout": "nhwc"})
    call = _call(node, modules)
    if call is None:
        return None
    op, x, params = call
    nd = int(op[-2])                    # pooled dimensions: max_pool2d -> 2, avg_pool3d -> 3
    shape = shape_of(x)
    k = _ntuple(params["kernel_size"], nd)
    stride = params["stride"]
    s = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else _ntuple(stride, nd)
    p = _ntuple(params["padding"], nd)
    if shape is None or len(shape) != nd + 2 or k is None or s is None or p is None:
        return None
    if min(k) < 1 or min(s) < 1 or min(p) < 0 or any(pi > ki // 2 for pi, ki in zip(p, k)):
        return None          # PyTorch's own error, or not a pooling we reproduce
    if params["ceil_mode"] is not False:
        return None
    if op.startswith("max") and (_ntuple(params["dilation"], nd) != (1,) * nd or params["return_indices"] is not False):
        return None
    if op.startswith("avg") and (params["count_include_pad"] is not True or params["divisor_override"] is not None):
        return None
    if any(shape[2 + d] + 2 * p[d] < k[d] for d in range(nd)):
        return None
    return OpInfo("pool", op, [x], {"kernel": k, "stride": s, "padding": p, "layout": "nchw"})


def supported(node: Node, modules: dict[str, nn.Module], device: str) -> Optional[tuple[Any, str, tuple, tuple, tuple]]:
    """(input, op, kernel, stride, padding) of a logical pooling node the kernels run (None: the
    library's): what ``layout.channels_last`` needs to put it on the view."""
    info = pool_info(node, modules, device)
    if info is None or info.params["layout"] != "nchw":
        return None
    p = info.params
    return info.operands[0], info.op, p["kernel"], p["stride"], p["padding"]


def emulate(info: OpInfo, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, for the replay's plan mode (``x``: the pool's input, in the
    replay's float64)."""
    p = info.params
    if p["layout"] == "nhwc":
        return pool_nhwc(x, info.op, p["kernel"], p["stride"], p["padding"])
    return _FN[info.op](x, p["kernel"], p["stride"], p["padding"])


def forward_statement(node: Node) -> Optional[list[str]]:
    """The candidate's lines for a ``pool_nhwc`` node left to PyTorch (None: not one): the pool
    of the logical tensor, permuted back to the view."""
    if node.op != "call_function" or node.target is not pool_nhwc:
        return None
    from agent.builtin.pysource import fmt, var

    x, op, k, s, p = node.args
    r = len(k) + 2
    to_logical, to_view = ", ".join(map(str, _to_logical(r))), ", ".join(map(str, _to_view(r)))
    return [f"# {len(k)}-D pooling of the channels-last view, on PyTorch",
            f"{var(node)} = F.{op}({fmt(x)}.permute({to_logical}), {k!r}, {s!r}, {p!r}).permute({to_view})"]


def fixed_meta(params: dict[str, Any]) -> int:
    """The meta entries a pooling kernel's launch reads before its operands' runs: meta[0] and
    ``wrapper_sizes``' seven, and a 3-D pool's D and OD after them."""
    return 8 if len(params["kernel"]) == 2 else 10


def wrapper_sizes(params: dict[str, Any]) -> list[str]:
    """The wrapper's C++ lines for a pooling kernel's sizes (``sp``: its input's sizes): meta[1..7]
    (outputs, N, C, H, W, OH, OW), and for a 3-D pool meta[8..9] (D, OD), and its output shape ``osh``:
    (N, C, [OD,] OH, OW), or (N, [OD,] OH, OW, C) on the channels-last view."""
    nd = len(params["kernel"])
    nhwc = params["layout"] == "nhwc"
    dims = "DHW"[3 - nd:]
    first = 1 if nhwc else 2                       # the first pooled dimension of the input
    sizes = [f"{d} = sp[{first + i}]" for i, d in enumerate(dims)]
    fits = " && ".join(f"{d} + {2 * pd} >= {kd}" for d, kd, pd in zip(dims, params["kernel"], params["padding"]))
    outs = ", ".join(f"O{d}" for d in dims)
    lines = [f"const int64_t N = sp[0], C = sp[{nd + 1 if nhwc else 1}], {', '.join(sizes)};",
             f"TORCH_CHECK({fits}, who, " '": the pooling window is larger than the padded input");',
             "const int64_t " + ", ".join(f"O{d} = ({d} + {2 * pd} - {kd}) / {sd} + 1" for d, kd, sd, pd
                                          in zip(dims, params["kernel"], params["stride"], params["padding"])) + ";",
             "const std::vector<int64_t> osh{" + (f"N, {outs}, C" if nhwc else f"N, C, {outs}") + "};"]
    for v in (f"N * C * {' * '.join(f'O{d}' for d in dims)}", "N", "C", "H", "W", "OH", "OW",
              *(("D", "OD") if nd == 3 else ())):
        lines.append(f"meta.push_back((long long)({v}));")
    return lines
