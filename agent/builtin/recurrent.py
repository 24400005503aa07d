"""Recurrent layers in kernels of their own: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh or relu)
calls in the traced graph (fx leaves, ``call_module`` nodes) run as generated code instead of
the library's layer (KernelBench level3/35-42: up to 6 layers, bidirectional, hidden 256,
sequences of 512).

Per layer and direction the input projection of every time step is one library GEMM
(``x[T*B, in] @ W_ih^T + b_ih``, plus ``b_hh`` for LSTM and RNN; for GRU only the r and z parts
of ``b_hh``: the n gate's ``b_hn`` stays inside ``r * (W_hn h + b_hn)``, as PyTorch's formula
has it). Then the time loop, with the recurrent product ``W_hh h``, the gates' activations and
the state update fused:

* CUDA (``cuda_rnn.cu.j2``): one persistent kernel launch per layer, both directions in it.
  Each block owns a slice of hidden units, keeps its rows of ``W_hh`` in shared memory where
  they fit, and the steps are separated by a grid-wide barrier (atomics and fences, per
  direction). The launch is cooperative and sized by the occupancy calculator, so the grid is
  always co-resident; where it cannot be, the wrapper calls the library's layer instead.
* CPU (``cpu_rnn.cpp.j2``): the same structure in C++, the recurrent product and the cell
  update in ``omp simd`` loops.

Everything in float32 with float32 accumulation; the host side (``rnn_host.cpp.j2``) stacks
the layers, concatenates the directions and fills ``h_n`` (and ``c_n``) in PyTorch's order
(``layer * directions + direction``). Matched only where the semantics are PyTorch's exactly:
a batched 3-d float32 input, no ``proj_size``, no dropout between layers (``p == 0`` or one
layer), an initial state absent (zeros) or given as tensors of the states' shapes. Anything
else stays the library's call.

The ``recurrent`` knob keeps the other way as a variant: ``fused`` (these kernels) or
``library`` (the layer as the reference calls it), for measurement to choose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.fx import Node

from agent.builtin.dtypes import value_dtype
from agent.builtin.ops import shape_of

RECURRENT_MODES = ("fused", "library")
THREADS = 256                       # threads per block of the CUDA time loop
# per layer mode: (the op name in headers, gates per hidden unit)
_MODES = {"LSTM": ("lstm", 4), "GRU": ("gru", 3), "RNN_TANH": ("rnn_tanh", 1), "RNN_RELU": ("rnn_relu", 1)}


@dataclass
class Layer:
    """One matched recurrent call: the node, its module's configuration and its operands."""

    node: Node
    path: str                        # the module's dotted path
    op: str                          # lstm | gru | rnn_tanh | rnn_relu
    gates: int                       # 4, 3 or 1 rows of W per hidden unit
    layers: int
    dirs: int
    hidden: int
    input_size: int
    bias: bool
    batch_first: bool
    x: Node
    state: list[Node]                # [] (zeros), [h0] or [h0, c0]


def _node_shape(n: Any) -> Optional[tuple]:
    return tuple(shape_of(n)) if isinstance(n, Node) and shape_of(n) is not None else None


def _match(node: Node, modules: dict[str, nn.Module]) -> Optional[Layer]:
    if node.op != "call_module" or node.kwargs or not 1 <= len(node.args) <= 2:
        return None
    mod = modules.get(str(node.target))
    if not isinstance(mod, nn.RNNBase) or type(mod) not in (nn.LSTM, nn.GRU, nn.RNN) or mod.mode not in _MODES:
        return None
    if getattr(mod, "proj_size", 0) or (mod.dropout > 0 and mod.num_layers > 1):
        return None            # a projection, or dropout between layers: the library's
    op, gates = _MODES[mod.mode]
    x = node.args[0]
    xs = _node_shape(x)
    if xs is None or len(xs) != 3 or xs[-1] != mod.input_size or value_dtype(x) != torch.float32:
        return None
    if any(p.dtype != torch.float32 for p in mod.parameters()):
        return None
    dirs = 2 if mod.bidirectional else 1
    batch = xs[0] if mod.batch_first else xs[1]
    if min(xs) < 1:
        return None
    hx = node.args[1] if len(node.args) == 2 else None
    want = (mod.num_layers * dirs, batch, mod.hidden_size)
    if hx is None:
        state: list[Node] = []
    elif op == "lstm" and isinstance(hx, tuple) and len(hx) == 2:
        state = list(hx)
    elif op != "lstm" and isinstance(hx, Node):
        state = [hx]
    else:
        return None
    if any(_node_shape(s) != want or value_dtype(s) != torch.float32 for s in state):
        return None
    return Layer(node=node, path=str(node.target), op=op, gates=gates, layers=mod.num_layers, dirs=dirs,
                 hidden=mod.hidden_size, input_size=mod.input_size, bias=mod.bias,
                 batch_first=mod.batch_first, x=x, state=state)


def find(gm_nodes: list[Node], modules: dict[str, nn.Module], blocked: set[str]) -> list[Layer]:
    """Every recurrent call of the graph this module runs, in graph order, none of them a
    ``blocked`` node name (left to PyTorch, or a failure the feedback narrowed)."""
    found = []
    for n in gm_nodes:
        layer = _match(n, modules) if n.name not in blocked else None
        if layer is not None:
            found.append(layer)
    return found


# --------------------------------------------------------------------------------------
# what the kernels compute, in float64 (the replay's plan mode)
# --------------------------------------------------------------------------------------
def _cell(op: str, xg: torch.Tensor, hg: torch.Tensor, h: torch.Tensor, c: Optional[torch.Tensor]):
    """One step from the input projection ``xg`` (biases in) and ``hg = W_hh h (+ b_hn)``."""
    if op == "lstm":
        i, f, g, o = (xg + hg).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if op == "gru":
        xr, xz, xn = xg.chunk(3, -1)
        hr, hz, hn = hg.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None
    a = xg + hg
    return (torch.tanh(a) if op == "rnn_tanh" else torch.relu(a)), None


def emulate(layer: Layer, x: torch.Tensor, state: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels' result from the formulas of PyTorch's documentation, in float64, rounded once
    to ``x``'s dtype: ``[output, h_n]`` (``+ [c_n]`` for LSTM), as the extension returns it."""
    dtype = x.dtype
    seq = (x.transpose(0, 1) if layer.batch_first else x).double()
    steps, batch, hid = seq.shape[0], seq.shape[1], layer.hidden
    per = 4 if layer.bias else 2
    zeros = seq.new_zeros(layer.layers * layer.dirs, batch, hid)
    h0 = state[0].double() if state else zeros
    c0 = state[1].double() if len(state) > 1 else zeros
    hn, cn = [], []
    for li in range(layer.layers):
        outs = []
        for d in range(layer.dirs):
            k = li * layer.dirs + d
            w = [t.double() for t in weights[k * per:(k + 1) * per]]
            b_ih, b_hh = (w[2], w[3]) if layer.bias else (0.0, 0.0)
            h, c = h0[k], c0[k]
            ys = [None] * steps
            for s in range(steps):
                t = steps - 1 - s if d else s
                xg = seq[t] @ w[0].T + b_ih
                hg = h @ w[1].T + b_hh
                h, c = _cell(layer.op, xg, hg, h, c)
                ys[t] = h
            outs.append(torch.stack(ys))
            hn.append(h)
            cn.append(c)
        seq = torch.cat(outs, -1)
    out = seq.transpose(0, 1) if layer.batch_first else seq
    result = [out, torch.stack(hn)] + ([torch.stack(cn)] if layer.op == "lstm" else [])
    return [r.to(dtype) for r in result]


# --------------------------------------------------------------------------------------
# code generation
# --------------------------------------------------------------------------------------
class RnnKernel:
    """The kernel-group view of one recurrent call, as codegen, feedback, replay and the header read it."""

    kind = "recurrent"

    def __init__(self, layer: Layer, index: int):
        self.layer = layer
        self.name = f"kl_g{index}"
        self.nodes = [layer.node]
        self.out_node = layer.node
        self.out_dtype = torch.float32
        self.ops = [layer.op]
        self.inputs: list[Any] = []              # the replay calls ``replay`` with the call's arguments
        self.dtypes = {torch.float32}
        self.has_half = False

    def describe(self) -> str:
        ly = self.layer
        return (f"{ly.op} ({ly.layers} layer(s){', bidirectional' if ly.dirs == 2 else ''}, hidden {ly.hidden}"
                f"{', batch_first' if ly.batch_first else ''}) with its own time loop")

    def replay(self, args: list[Any], model: nn.Module, mode: str) -> list[torch.Tensor]:
        """The extension's call ``(x, state, weights)`` emulated: ``plan`` the float64 formulas,
        ``torch`` the module itself (PyTorch's bits)."""
        x, state, weights = args
        if mode == "plan":
            return emulate(self.layer, x, list(state), list(weights))
        mod = model.get_submodule(self.layer.path)
        hx = None if not state else (tuple(state) if self.layer.op == "lstm" else state[0])
        out, hn = mod(x, hx)
        return [out, *(hn if isinstance(hn, tuple) else (hn,))]


class RnnCode:
    """GroupCode's interface for one recurrent call: its kernel, host function and Python call."""

    def __init__(self, kg: RnnKernel, device: str, knobs: Any):
        self.kg = kg
        self.device = device
        self.knobs = knobs

    @property
    def uses_knobs(self) -> set[str]:
        return {"recurrent"}

    def summary_line(self) -> str:
        """The candidate's docstring line for this kernel (GroupCode's interface)."""
        kg = self.kg
        loop = ("one persistent cooperative kernel per layer (both directions), W_hh rows in shared memory, a grid "
                "barrier between steps; the library's layer where the grid cannot be co-resident"
                if self.device == "cuda" else "a C++ loop over the steps")
        return (f"{kg.name}: {kg.describe()} (node {kg.layer.node.name}): the input projection of all steps as one "
                f"library GEMM per layer and direction, then {loop}, with W_hh h, the gates and the state update "
                "fused, float32 accumulation.")

    def _ctx(self) -> dict[str, Any]:
        ly = self.kg.layer
        return dict(name=self.kg.name, describe=self.kg.describe(), op=ly.op, gates=ly.gates, layers=ly.layers,
                    dirs=ly.dirs, hidden=ly.hidden, bias=ly.bias, batch_first=ly.batch_first,
                    threads=THREADS, device=self.device)

    def kernel_source(self) -> str:
        from agent.builtin.codegen import cpu_math, render

        if self.device == "cuda":
            return render("cuda_rnn.cu.j2", **self._ctx())
        return cpu_math(render("cpu_rnn.cpp.j2", **self._ctx()))

    def wrapper(self) -> dict[str, Any]:
        from agent.builtin.codegen import render

        return {"name": self.kg.name, "source": render("rnn_host.cpp.j2", **self._ctx())}

    def python_call(self) -> list[str]:
        from agent.builtin.pysource import attr_path, var

        ly, out = self.kg.layer, var(self.kg.out_node)
        mod = attr_path(ly.path)
        state = ", ".join(var(s) for s in ly.state)
        shaped = f"({out}[0], ({out}[1], {out}[2]))" if ly.op == "lstm" else f"({out}[0], {out}[1])"
        return [f"{out} = _ext.{self.kg.name}({var(ly.x)}, [{state}], [_p for _ps in {mod}.all_weights for _p in _ps])",
                f"{out} = {shaped}"]


def codes(layers: list[Layer], first_index: int, device: str, knobs: Any) -> list[RnnCode]:
    return [RnnCode(RnnKernel(ly, first_index + i), device, knobs) for i, ly in enumerate(layers)]


__all__ = ["Layer", "RnnKernel", "RnnCode", "find", "codes", "emulate", "RECURRENT_MODES"]
