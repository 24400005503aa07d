"""An Elman RNN written as a Python loop (KernelBench level3/34_VanillaRNNHidden), unrolled by the
trace into one block of nodes per step, runs as one recurrent layer (``recurrent.py``'s kernels).

Per step ``t`` the trace holds::

    g_t = x[t]                      # getitem of the 3-d input, the step's index
    c_t = cat((g_t, h_{t-1}), 1)    # h_{-1}: the initial state, any (B, H) float32 node
    a_t = i2h(c_t)                  # one nn.Linear for every step: (I + H) -> H
    h_t = tanh(a_t)                 # nn.Tanh, torch.tanh or .tanh() (the plan's classification)
    y_t = h2o(h_t)                  # one nn.Linear for every step: H -> O
    stack([y_0, ..., y_{T-1}], 0)

and nothing else reads those nodes. Since ``i2h(cat(x_t, h)) = x_t W[:, :I]^T + b + h W[:, I:]^T``,
that is ``nn.RNN(I, H)``'s tanh layer with ``W_ih = W[:, :I]``, ``W_hh = W[:, I:]``, ``b_ih = b`` and
``b_hh = 0``: the input projection of all steps one GEMM, the time loop one kernel (the recurrent
product, the tanh and the state update fused), and ``h2o`` once over the stacked states (one GEMM of
``T * B`` rows instead of ``T`` of ``B``). Matched from ``LONE_MIN_CALLS`` steps on; a shorter loop
keeps a kernel per step (one shared kernel, ``codegen.share_kernels``), where launches are few.
The ``recurrent`` knob's ``library`` variant keeps the loop as the reference writes it.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.fx import Node

from agent.builtin.dtypes import value_dtype
from agent.builtin.ops import shape_of
from agent.builtin.recurrent import Layer, RnnCode, RnnKernel, emulate

MIN_STEPS = 16          # agent.builtin.LONE_MIN_CALLS: from here on a kernel per step loses to the loop


def _shape(n: Any) -> Optional[tuple]:
    return tuple(int(d) for d in shape_of(n)) if isinstance(n, Node) and shape_of(n) is not None else None


def _only_user(n: Node, user: Node) -> bool:
    return set(n.users) == {user}


def _dim(n: Node, default: int = 0) -> Any:
    return n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else default)


class Loop:
    """One matched unrolled loop: the layer it is, its modules and its nodes."""

    def __init__(self, layer: Layer, i2h: str, h2o: str, h0: Node, nodes: list[Node], steps: int):
        self.layer, self.i2h, self.h2o, self.h0, self.nodes, self.steps = layer, i2h, h2o, h0, nodes, steps


def _match(stack: Node, modules: dict[str, nn.Module], infos: dict[Node, Any]) -> Optional[Loop]:
    if stack.op != "call_function" or stack.target is not torch.stack or _dim(stack) != 0:
        return None
    outs = stack.args[0]
    if not isinstance(outs, (list, tuple)) or len(outs) < MIN_STEPS or not all(isinstance(y, Node) for y in outs):
        return None
    h2o = outs[0].target if outs[0].op == "call_module" else None
    i2h = x = h0 = None
    prev: Optional[Node] = None
    nodes: list[Node] = []
    for t, y in enumerate(outs):
        if y.op != "call_module" or y.target != h2o or len(y.args) != 1 or y.kwargs or not _only_user(y, stack):
            return None
        h = y.args[0]
        last = t == len(outs) - 1
        if not isinstance(h, Node) or infos[h].op != "tanh" or len(h.args) != 1:
            return None
        a = h.args[0]
        if not isinstance(a, Node) or a.op != "call_module" or len(a.args) != 1 or a.kwargs or not _only_user(a, h):
            return None
        i2h = a.target if i2h is None else i2h
        c = a.args[0]
        if a.target != i2h or not isinstance(c, Node) or c.op != "call_function" or c.target is not torch.cat:
            return None
        if _dim(c) not in (1, -1) or not _only_user(c, a) or len(c.args[0]) != 2:
            return None
        g, before = c.args[0]
        if not isinstance(g, Node) or g.op != "call_function" or g.target is not operator.getitem:
            return None
        if g.args[1] != t or not _only_user(g, c) or (x is not None and g.args[0] is not x):
            return None
        x = g.args[0]
        if t == 0:
            h0 = before
        elif before is not prev:
            return None
        # h_t feeds the next step's cat and its own output, nothing else
        if set(h.users) != ({y} if last else {y, next_cat(outs, t)}):
            return None
        nodes += [g, c, a, h, y]
        prev = h
    return _layer(stack, modules, str(i2h), str(h2o), x, h0, nodes + [stack], len(outs))


def next_cat(outs: Any, t: int) -> Optional[Node]:
    """Step ``t + 1``'s cat (through its output's tanh and i2h), or None where the shape differs."""
    try:
        return outs[t + 1].args[0].args[0].args[0]
    except (AttributeError, IndexError):
        return None


def _layer(stack: Node, modules: dict[str, nn.Module], i2h: str, h2o: str, x: Any, h0: Any,
           nodes: list[Node], steps: int) -> Optional[Loop]:
    lin_ih, lin_ho = modules.get(i2h), modules.get(h2o)
    if type(lin_ih) is not nn.Linear or type(lin_ho) is not nn.Linear:
        return None
    xs, hs = _shape(x), _shape(h0)
    if xs is None or hs is None or len(xs) != 3 or len(hs) != 2 or xs[0] != steps:
        return None                 # every step of the input, in order
    batch, hidden, inp = xs[1], lin_ih.out_features, xs[2]
    if hs != (batch, hidden) or lin_ih.in_features != inp + hidden or lin_ho.in_features != hidden:
        return None
    if any(value_dtype(n) != torch.float32 for n in (x, h0)) or \
            any(p.dtype != torch.float32 for p in list(lin_ih.parameters()) + list(lin_ho.parameters())):
        return None
    layer = Layer(node=stack, path=i2h, op="rnn_tanh", gates=1, layers=1, dirs=1, hidden=hidden, input_size=inp,
                  bias=lin_ih.bias is not None, batch_first=False, x=x, state=[h0])
    return Loop(layer, i2h, h2o, h0, nodes, steps)


def find(gm_nodes: list[Node], modules: dict[str, nn.Module], infos: dict[Node, Any], blocked: set[str]) -> list[Loop]:
    """Every unrolled loop of the graph, none with a ``blocked`` node (left to PyTorch, or a
    failure the feedback narrowed); ``infos``: the plan's classification (``plan.classify_graph``),
    which names the tanh of every form (module, function, method)."""
    found = []
    for n in gm_nodes:
        loop = _match(n, modules, infos) if n.name not in blocked else None
        if loop is not None and not any(m.name in blocked for m in loop.nodes):
            found.append(loop)
    return found


class LoopKernel(RnnKernel):
    """``RnnKernel`` for an unrolled loop: every node of the loop is the kernel's, the stack its output."""

    def __init__(self, loop: Loop, index: int):
        super().__init__(loop.layer, index)
        self.loop = loop
        self.nodes = list(loop.nodes)
        self.out_node = loop.layer.node
        self.ops = ["rnn_tanh", "linear"]

    def describe(self) -> str:
        ly = self.layer
        return (f"the unrolled loop of {self.loop.steps} steps h = tanh({self.loop.i2h}(cat(x[t], h))), "
                f"hidden {ly.hidden}, as one tanh RNN layer with its own time loop; {self.loop.h2o} over every step at once")

    def replay(self, args: list[Any], model: nn.Module, mode: str) -> list[torch.Tensor]:
        """The extension's call ``(x, [h0[None]], [W_ih, W_hh(, b_ih, b_hh)])``: ``plan`` the float64
        formulas, ``torch`` the reference's own steps (PyTorch's bits)."""
        x, state, weights = args
        if mode == "plan":
            return emulate(self.layer, x, list(state), list(weights))
        w = torch.cat([weights[0], weights[1]], 1)
        b = weights[2] if self.layer.bias else None
        h = state[0][0]
        ys = []
        for t in range(x.shape[0]):
            h = torch.tanh(torch.nn.functional.linear(torch.cat((x[t], h), 1), w, b))
            ys.append(h)
        return [torch.stack(ys), h[None]]


class LoopCode(RnnCode):
    """``RnnCode`` with the loop's own call: the weights split, the initial state given a layer
    axis, ``h2o`` applied to the stacked states."""

    def summary_line(self) -> str:
        loop = ("one persistent cooperative kernel, W_hh rows in shared memory, a grid barrier between steps"
                if self.device == "cuda" else "a C++ loop over the steps")
        return (f"{self.kg.name}: {self.kg.describe()}: the input projection of all steps as one library GEMM, then "
                f"{loop}, with W_hh h, the tanh and the state update fused, float32 accumulation; then one GEMM for "
                f"{self.kg.loop.h2o}.")

    def python_call(self) -> list[str]:
        from agent.builtin.pysource import attr_path, var

        loop, ly, out = self.kg.loop, self.kg.layer, var(self.kg.out_node)
        i2h, h2o = attr_path(loop.i2h), attr_path(loop.h2o)
        inp = ly.input_size
        weights = f"{i2h}.weight[:, :{inp}], {i2h}.weight[:, {inp}:]"
        if ly.bias:
            weights += f", {i2h}.bias, torch.zeros_like({i2h}.bias)"
        return [f"{out}_seq = _ext.{self.kg.name}({var(ly.x)}, [{var(loop.h0)}.unsqueeze(0)], [{weights}])",
                f"{out} = torch.nn.functional.linear({out}_seq[0], {h2o}.weight, {h2o}.bias)"]


def codes(loops: list[Loop], first_index: int, device: str, knobs: Any) -> list[LoopCode]:
    return [LoopCode(LoopKernel(lp, first_index + i), device, knobs) for i, lp in enumerate(loops)]


__all__ = ["Loop", "LoopKernel", "LoopCode", "find", "codes", "MIN_STEPS"]
