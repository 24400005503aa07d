"""Channels-last layout for convolution tasks: the ``layout`` knob's ``nhwc``.

torch.compile wins on convolution tasks chiefly by layout (inductor's ``decide_layout_opt``):
cuDNN's convolutions run fastest with channels-last tensors, and the epilogue that follows
reads the convolution's output once. ``channels_last(traced)`` rewrites a traced graph so:

* every 2-D/3-D convolution reads its input in channels-last memory (``x.to(memory_format=...)``;
  a no-op when it already is) and its weight is converted once, when the model is built
  (``weights``: the parameter paths the candidate's ``__init__`` converts), so cuDNN writes a
  channels-last output;
* the fusible operators after it work on the *permuted view* of that output, ``(N, H, W, C)``
  (contiguous, no copy): elementwise operators with their operands permuted alike (a per-channel
  operand such as the split-off bias becomes a ``(C,)`` vector), reductions with their
  dimensions renumbered - a reduction over channels becomes one over the innermost, contiguous
  dimension, which the reduction kernels do a warp per pixel. The generated kernels then read
  the convolution's output once, in its own memory order;
* where a value leaves that region (a library operator, the output) it is permuted back to its
  logical shape (channels-last memory, which PyTorch's operators accept); a batch, instance or group
  norm module fed by the view runs on it (``norm_nhwc.NormChannelsLast``: per column of
  ``(N * spatial, C)``, per sample's columns, or per group of adjacent columns: the column kernels'
  layout), its prologue and epilogue with it; a graph where the view would feed another norm (a
  layer norm, a functional or wide-grouped group norm) stays NCHW: the norm's fused prologue in one
  NCHW kernel beats a copy back plus a separate kernel (session z measured the price of NCHW:
  cuDNN writing it took about twice its channels-last time on level2/17, 21, 85, 92);
* 2-D pooling on a channels-last tensor keeps the layout, so the operators after it stay in the
  permuted view too; a 2-D or 3-D pooling the generated kernels reproduce (``pool.py``) runs on the
  view itself (``pool_nhwc``), so it fuses with the chains around it.

The rewrite changes which memory each value lives in, never a value: the same operators in the
same order on the same numbers (the reduction kernels' summation order over channels differs as
any layout's would). The CPU target takes the same path (same plan shapes, C++ kernels).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from agent.builtin.norm_nhwc import NormChannelsLast, applies as norm_applies, copies_for, target_for as nhwc_target
from agent.builtin.ops import OpInfo, shape_of
from agent.builtin.pool import forward_statement as pool_forward_statement
from agent.builtin.pool import pool_nhwc, supported as pool_supported
from agent.builtin.trace import Traced

LAYOUTS = ("nchw", "nhwc")

_CONV_FUNCS = {F.conv2d, F.conv3d, F.conv_transpose2d, F.conv_transpose3d, torch.conv2d, torch.conv3d}
_CONV_MODULES = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# library operators whose output keeps a channels-last input's layout (CPU and CUDA)
_KEEP_FUNCS = {F.max_pool2d, F.avg_pool2d, torch.max_pool2d}
_KEEP_MODULES = (nn.MaxPool2d, nn.AvgPool2d)
_REDUCE_FN = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin,
              "logsumexp": torch.logsumexp}


@dataclass
class ChannelsLast:
    traced: Traced                       # the rewritten graph (same spec, modules, constants)
    weights: list[tuple[str, int]] = field(default_factory=list)   # (parameter path, rank) to convert at init


def _perm(rank: int) -> tuple[int, ...]:
    return (0, *range(2, rank), 1)


def _inv(rank: int) -> tuple[int, ...]:
    return (0, rank - 1, *range(1, rank - 1))


def memory_format(rank: int) -> str:
    return "torch.channels_last" if rank == 4 else "torch.channels_last_3d"


def _conv_of(node: Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The weight's parameter path of a 2-D/3-D convolution node (None: not one we convert)."""
    shape = shape_of(node)
    if shape is None or len(shape) not in (4, 5):
        return None
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), _CONV_MODULES):
        return f"{node.target}.weight"
    if node.op == "call_function" and node.target in _CONV_FUNCS and len(node.args) >= 2:
        w = node.args[1]
        if isinstance(w, Node) and w.op == "get_attr":
            return str(w.target)
        return ""               # a weight computed in forward: converted per call by cuDNN itself
    return None


def _grouped(node: Node, modules: dict[str, nn.Module]) -> bool:
    """A grouped convolution with more than one input channel per group."""
    if node.op == "call_module":
        mod = modules[str(node.target)]
        return mod.groups > 1 and mod.in_channels // mod.groups > 1
    # F.conv2d/conv3d and F.conv_transpose2d/3d both take groups as their seventh argument
    groups = node.kwargs.get("groups", node.args[6] if len(node.args) > 6 else 1)
    w = shape_of(node.args[1]) if isinstance(node.args[1], Node) else None
    if not isinstance(groups, int) or groups < 1 or w is None:
        return True
    transposed = node.target in (F.conv_transpose2d, F.conv_transpose3d)
    per_group = w[0] // groups if transposed else w[1]
    return groups != 1 and per_group > 1


def _keeps_layout(node: Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _KEEP_MODULES)
    return node.op == "call_function" and node.target in _KEEP_FUNCS


def channels_last(traced: Traced, infos: dict[Node, OpInfo]) -> Optional[ChannelsLast]:
    """The graph with its convolutions in channels-last and their epilogues on the permuted view,
    or None where the graph has no 2-D/3-D convolution (the knob changes nothing)."""
    gm = traced.gm
    assert gm is not None
    modules = traced.modules
    nodes = list(gm.graph.nodes)
    convs = [n for n in nodes if _conv_of(n, modules) is not None]
    if not convs or any(_grouped(n, modules) for n in convs):
        return None     # no convolution, or a grouped one (inductor's decide_layout_opt: far slower in channels-last)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if any(n.meta.get("tensor_meta") is None for n in placeholders):
        return None                      # a non-tensor input: no shapes to propagate with

    g = Graph()
    nat: dict[Node, Node] = {}           # old node -> new node with its logical (NCHW) value
    dom: dict[Node, Node] = {}           # old node -> new node with its permuted (NHWC) view
    rank_of: dict[Node, int] = {}        # old node -> rank of its channels-last value
    weights: list[tuple[str, int]] = []
    wrappers: dict[str, NormChannelsLast] = {}
    norm_after = False

    def natural(o: Any) -> Any:
        if not isinstance(o, Node):
            return o
        if o not in nat:
            nat[o] = g.call_method("permute", (dom[o], *_inv(rank_of[o])))
        return nat[o]

    def view(o: Node, rank: int) -> Node:
        """A tensor operand of an operator on the permuted view of rank ``rank``."""
        if o in dom and rank_of[o] == rank:
            return dom[o]
        if o in rank_of and rank_of[o] == rank:       # channels-last memory: permuting is free
            dom[o] = g.call_method("permute", (nat[o], *_perm(rank)))
            return dom[o]
        shape = shape_of(o)
        if shape is None or len(shape) == 0 or _numel(shape) == 1:
            return natural(o)
        if len(shape) > rank:
            raise _Skip()
        al = (1,) * (rank - len(shape)) + tuple(shape)
        if all(s == 1 for i, s in enumerate(al) if i != 1):
            return g.call_method("reshape", (natural(o), -1))          # per channel: a (C,) vector
        x = natural(o)
        for _ in range(rank - len(shape)):
            x = g.call_method("unsqueeze", (x, 0))
        return g.call_method("permute", (x, *_perm(rank)))

    def in_view(n: Node) -> Optional[int]:
        """The rank of the permuted view an operator can work on (None: it works on logical values)."""
        info = infos[n]
        if info.kind not in ("ew", "alias", "reduce") or info.mutates is not None:
            return None
        ranks = {rank_of[o] for o in info.operands if isinstance(o, Node) and o in rank_of}
        if len(ranks) != 1:
            return None
        r = ranks.pop()
        if info.kind == "reduce":
            x = info.operands[0]
            if not (isinstance(x, Node) and x in rank_of) or n.kwargs.get("dtype") is not None:
                return None
            return r
        shape = shape_of(n)
        return r if shape is not None and len(shape) == r else None

    for n in nodes:
        pooled = pool_supported(n, modules, traced.device)
        pr = len(pooled[2]) + 2 if pooled is not None else None       # the pool's input rank
        if pooled is not None and isinstance(pooled[0], Node) and rank_of.get(pooled[0]) == pr:
            dom[n] = g.call_function(pool_nhwc, (view(pooled[0], pr), *pooled[1:]))
            rank_of[n] = pr
            continue
        r = in_view(n)
        if r is not None:
            made = set(g.nodes)
            saved = (dict(nat), dict(dom), dict(rank_of))
            try:
                if infos[n].kind == "reduce":
                    _reduce(g, n, infos[n], view(infos[n].operands[0], r), r, nat, dom, rank_of)
                else:
                    dom[n] = g.node_copy(n, lambda a, r=r: view(a, r) if shape_of(a) is not None else natural(a))
                    rank_of[n] = r
                continue
            except _Skip:       # not expressible on the view: undo what was added, compute it logically
                for extra in reversed([m for m in g.nodes if m not in made]):
                    g.erase_node(extra)
                for d, old in zip((nat, dom, rank_of), saved):
                    d.clear()
                    d.update(old)
        path = _conv_of(n, modules)
        if path is not None:
            r = len(shape_of(n))
            x = n.args[0]
            xin = g.call_function(to_channels_last, (natural(x),))
            nat[n] = g.node_copy(n, lambda a, x=x, xin=xin: xin if a is x else natural(a))
            rank_of[n] = r
            if path:
                weights.append((path, r))
            continue
        on_view = _norm_on_view(n, modules, rank_of)
        if on_view is not None:
            # a batch, instance or group norm of the view: per column of (N * spatial, C), per
            # sample's columns, or per group of adjacent columns (norm_nhwc.py)
            path, r = on_view
            wrappers[path] = NormChannelsLast(modules[path], path)
            dom[n] = g.create_node("call_module", nhwc_target(path), (view(n.args[0], r),), name=n.name)
            rank_of[n] = r
            continue
        if infos[n].kind == "norm":
            # a norm reads its input in logical (contiguous) order: PyTorch's CPU group norm on a
            # channels-last tensor measured 1e-3 off a float64 run where the NCHW one is 3e-6 off
            # (the generated norm kernels copy it to contiguous anyway, so this costs them nothing)
            norm_after |= any(isinstance(a, Node) and a in rank_of for a in n.args)
            copied = g.node_copy(n, lambda a: g.call_function(to_logical, (natural(a),))
                                 if isinstance(a, Node) and a in rank_of else natural(a))
        else:
            copied = g.node_copy(n, natural)
        nat[n] = copied
        if _keeps_layout(n, modules) and n.args and isinstance(n.args[0], Node) and n.args[0] in rank_of:
            shape = shape_of(n)
            if shape is not None and len(shape) == rank_of[n.args[0]]:
                rank_of[n] = rank_of[n.args[0]]
    if norm_after:
        # a norm fed by the view would need a copy back and lose its fused prologue (one NCHW kernel
        # for bias, activations and the norm): these graphs stay NCHW
        return None
    for path, w in wrappers.items():         # the graph module copies its call_module targets from gm
        gm.add_submodule(nhwc_target(path), w)
    try:
        new_gm = GraphModule(gm, g)
    finally:
        for path in wrappers:
            delattr(gm, nhwc_target(path))
    device = next((p.device for p in gm.parameters()), torch.device("meta"))
    inputs = [torch.zeros(p.meta["tensor_meta"].shape, dtype=p.meta["tensor_meta"].dtype, device=device)
              for p in placeholders]
    ShapeProp(new_gm).propagate(*inputs)
    out = replace(traced, gm=new_gm, modules=dict(new_gm.named_modules()))
    return ChannelsLast(traced=out, weights=sorted(set(weights)))


def _norm_on_view(n: Node, modules: dict[str, nn.Module], rank_of: dict) -> Optional[tuple[str, int]]:
    """(module path, rank) of a norm module's call (``norm_nhwc.applies``) whose input is on the
    permuted view (None: not one): it runs there as ``norm_nhwc.NormChannelsLast``."""
    if n.op != "call_module" or len(n.args) != 1 or n.kwargs:
        return None
    x = n.args[0]
    r = rank_of.get(x) if isinstance(x, Node) else None
    path = str(n.target)
    if r is None or not norm_applies(modules.get(path), r):
        return None
    return path, r


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """A convolution's input in channels-last memory (the graph's node; the candidate calls the
    generated tiled transpose on cuda, see ``forward_statement``)."""
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


to_channels_last.kl_library = True      # ops.classify: a library operator, stays as it is


def to_logical(x: torch.Tensor) -> torch.Tensor:
    """A value leaving the view for a norm, copied to contiguous (logical) memory once. A library
    node, not an identity, so that a generated norm kernel reads the copy instead of copying again."""
    return x.contiguous()


to_logical.kl_library = True


def forward_statement(node: Node, kernel: bool, modules: dict[str, nn.Module]) -> Optional[list[str]]:
    """The candidate's lines (a comment, the statement) for a ``to_channels_last`` or ``to_logical``
    node, or a ``pool_nhwc`` or a norm of the view (``norm_nhwc``) left to PyTorch (None:
    none of them): the input copy is, with
    ``kernel`` (cuda, in a candidate that builds an extension anyway), the extension's ``kl_to_cl``
    (a tiled shared-memory transpose, coalesced on both sides), else PyTorch's copy."""
    if node.op == "call_function" and node.target is pool_nhwc:
        return pool_forward_statement(node)
    norm = norm_forward_statement(node, modules)
    if norm is not None:
        return norm
    if node.op != "call_function" or node.target not in (to_channels_last, to_logical):
        return None
    from agent.builtin.pysource import fmt, var

    x = fmt(node.args[0])
    if node.target is to_logical:
        return ["# back to logical (NCHW) memory for the norm", f"{var(node)} = {x}.contiguous()"]
    if kernel:
        stmt = f"{var(node)} = _ext.kl_to_cl({x})"
    else:
        shape = shape_of(node)
        stmt = f"{var(node)} = {x}.contiguous(memory_format={memory_format(len(shape) if shape else 4)})"
    return ["# the convolution's input in channels-last memory", stmt]


def norm_forward_statement(node: Node, modules: dict[str, nn.Module]) -> Optional[list[str]]:
    """The candidate's lines for a norm of the view left to PyTorch (None: not one): the model's own
    module on the logical tensor, permuted back to the view (a group or instance norm's input and
    output copied to contiguous memory, as ``norm_nhwc.apply_on_view`` does)."""
    wrapper = modules.get(str(node.target)) if node.op == "call_module" else None
    if not isinstance(wrapper, NormChannelsLast):
        return None
    from agent.builtin.pysource import attr_path, fmt, var

    r = len(node.meta["tensor_meta"].shape)
    to_logical = ", ".join(map(str, _inv(r)))
    to_view = ", ".join(map(str, _perm(r)))
    if not copies_for(wrapper.norm):
        call = f"{attr_path(wrapper.path)}({fmt(node.args[0])}.permute({to_logical})).permute({to_view})"
    else:
        call = (f"{attr_path(wrapper.path)}({fmt(node.args[0])}.permute({to_logical}).contiguous())"
                f".permute({to_view}).contiguous()")
    return [f"# {type(wrapper.norm).__name__} of the channels-last view, on PyTorch", f"{var(node)} = {call}"]


def uses_to_channels_last(traced: Traced) -> bool:
    return any(n.op == "call_function" and n.target is to_channels_last for n in traced.gm.graph.nodes)


class _Skip(Exception):
    pass


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _reduce(g: Graph, n: Node, info: OpInfo, x: Node, r: int, nat: dict, dom: dict, rank_of: dict) -> None:
    """A reduction on the permuted view: its dimensions renumbered. Its result is on the view
    (softmax, keepdim), or logical where the channel dimension is reduced away."""
    perm = _perm(r)
    dims = sorted(perm.index(d) for d in info.params["dims"])
    if dims != list(range(dims[0], dims[-1] + 1)):
        raise _Skip()
    if info.op in ("softmax", "log_softmax"):
        fn = torch.softmax if info.op == "softmax" else torch.log_softmax
        dom[n] = g.call_function(fn, (x, dims[0]))
        rank_of[n] = r
        return
    fn = _REDUCE_FN.get(info.op)
    if fn is None:
        raise _Skip()
    keep = bool(info.params["keepdim"])
    if keep:
        dom[n] = g.call_function(fn, (x,), {"dim": tuple(dims), "keepdim": True})
        rank_of[n] = r
        return
    left = [p for p in perm if perm.index(p) not in dims]
    if left != sorted(left):
        raise _Skip()            # the remaining dimensions would come out permuted
    nat[n] = g.call_function(fn, (x,), {"dim": tuple(dims), "keepdim": False})


def init_lines(weights: list[tuple[str, int]]) -> list[str]:
    """The candidate's ``__init__`` body: the reference's, then each convolution weight converted once."""
    from agent.builtin.pysource import attr_path

    lines = ["super().__init__(*args, **kwargs)",
             "# convolution weights in channels-last memory, once (cuDNN would convert them on every call)"]
    for path, r in weights:
        p = attr_path(path)
        lines.append(f"{p}.data = {p}.data.contiguous(memory_format={memory_format(r)})")
    return lines
