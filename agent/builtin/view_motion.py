"""Views moved out of the way of fusion (``move_views``, a rewrite of the traced graph before it is
planned, ``trace._trace_with``).

A ``view`` changes the iteration space, so the plan ends a fused group before it and starts
another after: level2/38's ``clamp(conv + bias).view(b, c, -1)``, ``softmax(dim=2)``,
``.view(b, c, d, h, w) * scale`` ran as three kernels (an add and clamp, the softmax, the
multiply), each a full read and write of the 1 GiB output (0.67x torch.compile on an H200,
session ad). Two moves, each keeping what the graph computes:

* **a merging view hoisted above its elementwise producer**: ``ew(a, b).view(*s[:k], -1)`` ->
  ``ew(a.flatten(k), b')``, where each tensor operand is either of the producer's full shape
  (flattened the same way) or constant along the merged dimensions (size 1 there: flattened to
  one dimension of size 1, so that it broadcasts as before); the producer's ``shape`` read
  elsewhere (``b, c, d, h, w = x.shape``) is read off its full-shaped operand instead;
* **a splitting view sunk below its elementwise consumer**: ``x.view(*s[:k], d, h, w) * scale``
  -> ``(x * scale').view(*s[:k], d, h, w)``, ``scale'`` as above along the split dimensions.

Repeated until nothing moves, the views of level2/38 end at the convolution's output and at the
model's output, and the add, clamp, softmax and multiply plan as one kernel. A view moves only
where it parts two operators the plan fuses and the chain it moves along ends where it parts none
(a library operator, an input, the output): else it would only move the break (a view of an input
before a sigmoid and a mean stays there; session ad's first rule sank it between them). A move needs the
producer's value nowhere else, operands the rule covers, and an operator the plan calls
elementwise, not in place, with no module parameters of its own (``nn.PReLU``'s per-channel
weight stays put).
Flattening is ``reshape``'s: a copy only where the tensor cannot be viewed, the same values.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from torch.fx import GraphModule, Node

from agent.builtin.ops import ModuleAttr, classify
from agent.builtin.ops import shape_of as _shape

_VIEWS = ("view", "reshape", "flatten")


def _is_view(node: Node) -> bool:
    return node.op == "call_method" and node.target in _VIEWS and isinstance(node.args[0], Node)


def _merged_at(src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[int]:
    """``k`` where ``dst`` is ``src`` with its dimensions ``k..`` merged into one (k >= 1), else None."""
    k = len(dst) - 1
    if k < 1 or len(src) <= len(dst) or src[:k] != dst[:k] or math.prod(src[k:]) != dst[k]:
        return None
    return k


def _elementwise(node: Node, modules: dict[str, Any]) -> bool:
    info = classify(node, modules, {})
    # an in-place operator on a flattened copy (a tensor that cannot be viewed) would miss its tensor
    return (info.kind == "ew" and info.mutates is None
            and not any(isinstance(o, ModuleAttr) for o in info.operands))


def _operand_flat(op: Node, full: tuple[int, ...], k: int) -> Optional[tuple[str, int]]:
    """How a tensor operand of an elementwise operator over ``full`` follows ``full``'s dimensions
    ``k..`` merged into one: ``("same", 0)`` (it broadcasts unchanged), ``("flatten", d)`` (its
    dimensions ``d..`` merged), or None (it varies along them, without ``full``'s shape)."""
    shape = _shape(op)
    if shape is None:
        return None
    m = len(full) - k                       # the merged dimensions, right-aligned
    if shape == full:
        return "flatten", k
    if len(shape) <= m:
        return ("same", 0) if all(s == 1 for s in shape) else None
    return ("flatten", len(shape) - m) if all(s == 1 for s in shape[-m:]) else None


def _flattened(graph: Any, op: Node, how: tuple[str, int]) -> Node:
    return op if how[0] == "same" else graph.call_method("flatten", (op, how[1]))


def _shape_reads(node: Node) -> list[Node]:
    return [u for u in node.users if (u.op == "call_function" and u.target is getattr and u.args[1:] == ("shape",))
            or (u.op == "call_method" and u.target == "size")]


_CALLS = ("call_function", "call_method", "call_module")


def _fusible(node: Node, modules: dict[str, Any]) -> bool:
    """Whether the plan may fuse ``node`` into a kernel with its neighbours (an input, a parameter, a
    library operator such as a convolution, or the output: no)."""
    return node.op in _CALLS and classify(node, modules, {}).fusible


def _up_step(node: Node, src: tuple[int, ...], k: int, modules: dict[str, Any]) -> Optional[tuple]:
    """How a view merging ``node``'s dimensions ``k..`` is hoisted above it: (its tensor operands,
    their flattenings, its shape reads, its full-shaped operand), or None where it cannot be."""
    if node.op not in _CALLS or _shape(node) != src or not _elementwise(node, modules):
        return None
    reads = _shape_reads(node)
    if len([u for u in node.users if u not in reads]) != 1:
        return None
    tensors = [n for n in node.all_input_nodes if _shape(n) is not None]
    hows = [_operand_flat(n, src, k) for n in tensors]
    full = next((n for n in tensors if _shape(n) == src), None)
    if not tensors or any(h is None for h in hows) or (reads and full is None):
        return None
    return tensors, hows, reads, full


def _up_to_boundary(node: Node, src: tuple[int, ...], k: int, modules: dict[str, Any]) -> bool:
    """Whether a view hoisted through ``node`` and on comes to rest where it breaks no fusion (on
    each full-shaped path, at a node the plan does not fuse): else it would only move the break."""
    step = _up_step(node, src, k, modules)
    if step is None:
        return not _fusible(node, modules)
    return all(_up_to_boundary(n, src, k, modules) for n in step[0] if _shape(n) == src)


def _down_step(node: Node, incoming: Node, dst: tuple[int, ...], k: int,
               modules: dict[str, Any]) -> Optional[tuple]:
    """How a view splitting ``incoming`` (to ``dst``, at ``k``) is sunk below its consumer ``node``:
    (the other tensor operands, their flattenings), or None where it cannot be."""
    if node.op not in _CALLS or _shape(node) != dst or not _elementwise(node, modules):
        return None
    others = [n for n in node.all_input_nodes if n is not incoming and _shape(n) is not None]
    hows = [_operand_flat(n, dst, k) for n in others]
    return None if any(h is None for h in hows) else (others, hows)


def _down_to_boundary(node: Node, dst: tuple[int, ...], k: int, modules: dict[str, Any]) -> bool:
    """Whether a view sunk below ``node`` and on comes to rest before the output or operators the
    plan does not fuse."""
    users = list(node.users)
    if len(users) == 1 and _down_step(users[0], node, dst, k, modules) is not None:
        return _down_to_boundary(users[0], dst, k, modules)
    return all(u.op == "output" or not _fusible(u, modules) for u in users)


def _hoist(view: Node, modules: dict[str, Any]) -> bool:
    """A merging ``view`` that parts two fusible operators hoisted above its elementwise producer,
    where the chain above ends at a boundary (the module's first move)."""
    producer = view.args[0]
    src, dst = _shape(producer), _shape(view)
    k = _merged_at(src, dst) if src and dst else None
    step = _up_step(producer, src, k, modules) if k is not None else None
    if step is None or not any(_fusible(u, modules) for u in view.users) \
            or not _up_to_boundary(producer, src, k, modules):
        return False
    tensors, hows, reads, full = step
    graph = producer.graph
    with graph.inserting_before(producer):
        for n, how in zip(tensors, hows):
            producer.replace_input_with(n, _flattened(graph, n, how))
    for read in reads:
        read.replace_input_with(producer, full)
    view.replace_all_uses_with(producer)
    graph.erase_node(view)
    return True


def _sink(view: Node, modules: dict[str, Any]) -> bool:
    """A splitting ``view``/``reshape`` that parts two fusible operators sunk below its one
    elementwise consumer, where the chain below ends at a boundary (the second move)."""
    if view.target == "flatten" or len(view.users) != 1:
        return False
    (consumer,) = view.users
    src, dst = _shape(view.args[0]), _shape(view)
    k = _merged_at(dst, src) if src and dst else None
    step = _down_step(consumer, view, dst, k, modules) if k is not None else None
    if step is None or not _fusible(view.args[0], modules) or not _down_to_boundary(consumer, dst, k, modules):
        return False
    graph = consumer.graph
    with graph.inserting_before(consumer):
        for n, how in zip(*step):
            consumer.replace_input_with(n, _flattened(graph, n, how))
    consumer.replace_input_with(view, view.args[0])
    with graph.inserting_after(consumer):
        moved = graph.call_method(view.target, (consumer, *view.args[1:]), dict(view.kwargs))
    consumer.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    graph.erase_node(view)
    return True


def move_views(gm: GraphModule, propagate: Callable[[], None]) -> bool:
    """Both moves, one at a time (``propagate`` gives every node its shape again after each),
    until neither applies. Returns whether the graph changed."""
    modules = dict(gm.named_modules())
    changed = False
    for _ in range(64):                 # each move takes a view one operator further: a chain is short
        moved = False
        for node in list(gm.graph.nodes):
            if _is_view(node) and (_hoist(node, modules) or _sink(node, modules)):
                moved = True
                break
        if not moved:
            break
        changed = True
        gm.graph.lint()
        gm.recompile()
        propagate()
    return changed

