"""Fusion planning: which nodes of the traced graph become which generated kernel.

A *group* is a topologically ordered run of fusible nodes with one output (its last node):

    prologue (elementwise, on the core's input shape) -> core (reduction, norm, 2-D/3-D pooling or direct convolution) -> epilogue (elementwise)

or an elementwise chain without a core. A direct convolution's group may end in a *tail*: a sum or
mean over all its spatial dims (``tail_reduction``), which the kernel accumulates from its
registers, so the convolution's output is never written (level2/67: conv, GELU, global average
pool). Groups grow greedily from producer to consumer; afterwards any group whose intermediate
value is needed outside it is cut right after that value, until every group has exactly one
escaping value.

Knobs that shape the plan:

* ``fusion``: ``max`` (prologue + core + epilogue, and a convolution's tail reduction),
  ``no_prologue`` (a core starts a new group: no tail either), ``split`` (cores stand alone,
  elementwise chains on their own), ``elementwise`` (reductions, normalisations and pooling stay
  on PyTorch, only elementwise chains are fused);
* ``cuts``: node names a group must end at (set by the feedback when a group failed);
* ``excluded``: node names left to PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch.fx import Node

from agent.builtin.dtypes import dtype_name, supported, value_dtype
from agent.builtin.ops import ModuleAttr, OpInfo, classify, shape_of
from agent.builtin.pool import pool_info
from agent.builtin.trace import Traced

FUSION_MODES = ("max", "no_prologue", "split", "elementwise")


@dataclass
class Group:
    nodes: list[Node] = field(default_factory=list)
    index: int = 0

    @property
    def name(self) -> str:
        return f"kl_g{self.index}"

    @property
    def output(self) -> Node:
        return self.nodes[-1]


@dataclass
class Plan:
    traced: Traced
    infos: dict[Node, OpInfo]
    groups: list[Group]
    group_of: dict[Node, Group]
    fusion: str
    excluded: set[str] = field(default_factory=set)

    def core_of(self, g: Group) -> Optional[Node]:
        return next((n for n in g.nodes if self.infos[n].is_core), None)

    def tail_of(self, g: Group) -> Optional[Node]:
        """The group's tail reduction (``tail_reduction``), None where it has none."""
        return group_tail(g.nodes, self.infos)


def group_tail(nodes: list[Node], infos: dict[Node, OpInfo]) -> Optional[Node]:
    """The last of ``nodes`` where it is a second core (a convolution's tail reduction), else None."""
    cores = [n for n in nodes if infos[n].is_core]
    return nodes[-1] if len(cores) == 2 and cores[1] is nodes[-1] else None


# The reductions a direct convolution's group may end in: over every spatial dim of its output
TAIL_OPS = ("sum", "mean")


def tail_reduction(conv: Node, node: Node, infos: dict[Node, OpInfo]) -> bool:
    """Whether ``node`` reduces a value in the space of the direct convolution ``conv`` (its output
    shape) over all the spatial dims, by sum or mean, in float32: one value per (sample, channel),
    which a convolution kernel can accumulate from its registers (``templates/cuda_conv.cu.j2``'s
    ``tail``) instead of writing the convolution's output for a reduction kernel to read again."""
    info, shape = infos[node], shape_of(conv)
    if infos[conv].kind != "conv" or info.kind != "reduce" or info.op not in TAIL_OPS or shape is None:
        return False
    data = info.operands[0]
    return (isinstance(data, Node) and shape_of(data) == shape and list(info.params["dims"]) == list(range(2, len(shape)))
            and all(value_dtype(v) == torch.float32 for v in (data, node)))


def classify_graph(traced: Traced) -> dict[Node, OpInfo]:
    assert traced.gm is not None
    infos = {}
    for node in traced.gm.graph.nodes:
        # a pooling call the kernels reproduce is a core (pool.py); any other stays the library's
        infos[node] = pool_info(node, traced.modules, traced.device) or classify(node, traced.modules, traced.constants)
    _check_dtypes(infos)
    _check_inplace(traced, infos)
    for info in infos.values():
        if info.fusible:
            info.operands = [resolve_alias(o, infos) if isinstance(o, Node) else o for o in info.operands]
    return infos


def resolve_alias(node: Node, infos: dict[Node, OpInfo]) -> Node:
    """Follow identities (nn.Identity, dropout with p=0, contiguous) back to their source."""
    while infos[node].kind == "alias" and isinstance(infos[node].operands[0], Node):
        node = infos[node].operands[0]
    return node


def effective_users(node: Node, infos: dict[Node, OpInfo]) -> list[Node]:
    """The users of a value, looking through identities."""
    out: list[Node] = []
    for u in node.users:
        if infos[u].kind == "alias" and infos[u].operands and infos[u].operands[0] is node:
            out.extend(effective_users(u, infos))
        else:
            out.append(u)
    return out


def _float_mask(info: OpInfo, t: Any) -> bool:
    """``masked_fill``'s bool mask, which the kernel reads as a float (``kernels.Input.dtype``)."""
    return info.op == "masked_fill" and len(info.operands) == 2 and t is info.operands[1] \
        and value_dtype(t) == torch.bool


def _check_dtypes(infos: dict[Node, OpInfo]) -> None:
    """The kernels load and store float32, float16 and bfloat16 (computing in float); an operator
    with a tensor of any other dtype stays on PyTorch."""
    for node, info in infos.items():
        if not info.fusible:
            continue
        tensors = [o for o in info.operands if isinstance(o, (Node, ModuleAttr))]
        bad = [value_dtype(t) for t in [node, *tensors] if not supported(value_dtype(t)) and not _float_mask(info, t)]
        if bad and info.kind == "pool":
            info.kind = "library"           # a pooling call as the reference makes it
            continue
        if bad:
            info.kind = "other"
            info.note = (f"a {dtype_name(bad[0])} tensor: the builtin kernels read float32, float16 and "
                         "bfloat16 only, it stays on PyTorch")
            continue
        if any(isinstance(o, Node) and shape_of(o) is None for o in info.operands):
            info.kind, info.note = "other", "an operand has no known tensor shape"


def _check_inplace(traced: Traced, infos: dict[Node, OpInfo]) -> None:
    """An in-place operator is fused (computed out of place) only where nothing else can see the
    overwritten tensor afterwards; otherwise it stays on PyTorch and acts as a barrier."""
    order = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    for node, info in infos.items():
        target = info.mutates
        if target is None:
            continue
        if info.kind not in ("ew", "alias"):
            continue
        # the tensor it overwrites, seen through identities (an identity shares its source's memory)
        chain = [target]
        while infos[chain[-1]].kind == "alias" and isinstance(infos[chain[-1]].operands[0], Node):
            chain.append(infos[chain[-1]].operands[0])
        root = chain[-1]
        readers = [u for t in chain for u in t.users if u is not node and u not in chain]
        later_users = [u for u in readers if order[u] > order[node]]
        if root.op in ("placeholder", "get_attr") or later_users or infos[root].kind == "plumb":
            info.kind = "other"
            info.note = "in-place update of a tensor that is read elsewhere: it stays on PyTorch"


def _epochs(traced: Traced, infos: dict[Node, OpInfo]) -> dict[Node, int]:
    """Nodes that mutate state on PyTorch's side are barriers no group may span."""
    epoch = 0
    out = {}
    for node in traced.gm.graph.nodes:
        out[node] = epoch
        info = infos[node]
        mutating = (info.kind == "other" and (info.mutates is not None or _looks_inplace(node)))
        if mutating:
            epoch += 1
    return out


def _looks_inplace(node: Node) -> bool:
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"):
        return True
    if node.op == "call_function" and getattr(node.target, "__name__", "").endswith("_"):
        return True
    return bool(node.kwargs.get("inplace")) or "out" in node.kwargs


def tensor_operands(info: OpInfo) -> list[Node]:
    return [o for o in info.operands if isinstance(o, Node)]


def make_plan(traced: Traced, fusion: str = "max", cuts: Iterable[str] = (),
              excluded: Iterable[str] = (), infos: Optional[dict[Node, OpInfo]] = None) -> Plan:
    if fusion not in FUSION_MODES:
        raise ValueError(f"unknown fusion mode {fusion!r}")
    infos = infos if infos is not None else classify_graph(traced)
    cuts, excluded = set(cuts), set(excluded)
    # a value the forward assigns to a module attribute is a group's output: the candidate assigns it too
    cuts |= {n.name for n in traced.rebinds.values()}
    epochs = _epochs(traced, infos)
    nodes = list(traced.gm.graph.nodes)
    group_of: dict[Node, Group] = {}
    groups: list[Group] = []

    def core(g: Group) -> Optional[Node]:
        return next((n for n in g.nodes if infos[n].is_core), None)

    def space_shape(g: Group) -> tuple:
        c = core(g)
        return shape_of(c) if c is not None else shape_of(g.nodes[0])

    def can_merge(g: Group, n: Node) -> bool:
        info = infos[n]
        last = g.nodes[-1]
        if last.name in cuts or epochs[last] != epochs[n]:
            return False
        c = core(g)
        if group_tail(g.nodes, infos) is not None:      # a tail reduction ends its group
            return False
        ins = [o for o in tensor_operands(info) if group_of.get(o) is g]
        if info.kind == "ew":
            if fusion == "split" and c is not None:
                return False
            if shape_of(n) != space_shape(g):
                return False
            if c is not None:
                # (a window core's epilogue element is not its prologue's, whatever the shapes)
                same_space = infos[c].kind not in ("pool", "conv") and shape_of(c) == shape_of(infos[c].operands[0])
                pre = g.nodes[:g.nodes.index(c)]
                if not same_space and any(o in pre for o in ins):
                    return False
            return True
        # a core
        if c is not None and fusion == "max" and tail_reduction(c, n, infos):
            # a direct convolution's tail: its value is the group's last (so no other operand of the group)
            return info.operands[0] is last and len(tensor_operands(info)) == 1
        if c is not None or fusion in ("split", "no_prologue"):
            return False
        data = info.operands[0]
        if group_of.get(data) is not g:
            return False
        if any(o is not data and group_of.get(o) is g for o in tensor_operands(info)):
            return False
        return shape_of(data) == space_shape(g)

    for n in nodes:
        info = infos[n]
        if not info.fusible or n.name in excluded or (fusion == "elementwise" and info.is_core):
            continue
        placed = False
        seen: list[Group] = []
        for o in tensor_operands(info):
            g = group_of.get(o)
            if g is None or g in seen:
                continue
            seen.append(g)
            if o is not g.nodes[-1] and info.kind != "ew":
                continue
            if can_merge(g, n):
                g.nodes.append(n)
                group_of[n] = g
                placed = True
                break
        if not placed:
            g = Group([n])
            groups.append(g)
            group_of[n] = g

    groups = _split_escapes(nodes, groups, group_of, infos)
    order = {n: i for i, n in enumerate(nodes)}
    groups.sort(key=lambda g: order[g.nodes[-1]])
    for i, g in enumerate(groups):
        g.index = i
    return Plan(traced=traced, infos=infos, groups=groups, group_of=group_of, fusion=fusion, excluded=excluded)


def _split_escapes(nodes: list[Node], groups: list[Group], group_of: dict[Node, Group],
                   infos: dict[Node, OpInfo]) -> list[Group]:
    """Cut groups after every value that is used outside its group, until none is."""
    changed = True
    while changed:
        changed = False
        new_groups: list[Group] = []
        for g in groups:
            cut_at = None
            for i, n in enumerate(g.nodes[:-1]):
                if any(group_of.get(u) is not g for u in effective_users(n, infos)):
                    cut_at = i
                    break
            if cut_at is None:
                new_groups.append(g)
                continue
            changed = True
            a, b = Group(g.nodes[:cut_at + 1]), Group(g.nodes[cut_at + 1:])
            for n in a.nodes:
                group_of[n] = a
            for n in b.nodes:
                group_of[n] = b
            new_groups.extend([a, b])
        groups = new_groups
    return groups


def narrow(nodes: list[str], kinds: list[str]) -> tuple[set[str], set[str]]:
    """How to narrow a failed group: (cuts, excluded) to add.

    A group with a core and elementwise neighbours is split around the core; an
    elementwise chain is halved; a single operator is left to PyTorch.
    """
    if len(nodes) <= 1:
        return set(), set(nodes)
    core_idx = [i for i, k in enumerate(kinds) if k in ("reduce", "norm", "pool", "conv")]
    if core_idx:
        i = core_idx[0]
        cuts = set()
        if i > 0:
            cuts.add(nodes[i - 1])
        if i < len(nodes) - 1:
            cuts.add(nodes[i])
        return cuts, set()
    mid = (len(nodes) - 1) // 2
    return {nodes[mid]}, set()
