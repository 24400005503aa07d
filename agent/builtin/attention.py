"""Attention in one kernel: ``(q @ k^T) * scale -> masked_fill(mask == 0, -inf) -> softmax | relu
-> [identities] -> @ v`` recognised in the traced graph and replaced by one generated kernel.

The pattern (minGPT's causal self-attention, level3/43, and its ReLU variant, level3/50):

    att = (q @ k.transpose(-2, -1)) * scale        # or / d, or no scale
    att = att.masked_fill(mask == 0, float("-inf"))   # optional
    att = F.softmax(att, dim=-1)                    # or F.relu(att)
    att = dropout(att)                              # optional, p = 0 (an identity)
    y = att @ v

with q ``[B, H, T, D]``, k ``[B, H, S, D]``, v ``[B, H, S, E]`` (any strides), D and E at most
128, a mask that broadcasts to ``[B, H, T, S]``, every intermediate used only inside the span.
The QKV and output projections stay library GEMMs.

The kernel (``cuda_attn.cu.j2``, ``cpu_attn.cpp.j2``) is flash-style: a query row's scores are
computed key by key against the row, never stored; under softmax an online max and sum rescale
the float32 accumulator (so the T x S matrix is never written), under ReLU the masked,
rectified scores times V are accumulated as they are. The mask is read, not assumed: a first
pass on the device checks that the mask is zero above the diagonal (a causal mask, as the
``tril`` buffer sliced ``[:, :, :T, :T]`` is) and sets a flag; with the flag the kernel skips
every key after the query's row (the CUDA kernel whole key tiles past the query tile), without
it every key is visited. Masked and -inf scores contribute nothing, a row whose scores are all
masked gives softmax's NaN; loads convert to float, every sum accumulates in float32, the output
is rounded once on store (see ``dtypes``).

The ``attention`` knob keeps the other way as a variant: ``fused`` (this kernel) or ``library``
(the two matmuls on PyTorch, the softmax/relu a generated kernel), for measurement to choose.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from agent.builtin.dtypes import at_type, c_type, is_half, supported, value_dtype
from agent.builtin.ops import OpInfo, shape_of
from agent.builtin.plan import effective_users

MAX_HEAD_DIM = 128
HEAD_DIMS = (32, 64, 96, 128)        # register tiles of the CUDA kernel (the head dim padded up)
ATTENTION_MODES = ("fused", "library")

_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)
_EQ = (operator.eq, torch.eq)


@dataclass
class Span:
    """One matched attention: the nodes it replaces (graph order) and its operands."""

    nodes: list[Node]
    q: Node
    k: Node
    v: Node
    mask: Optional[Node]
    scale: Union[Node, float, None]   # a non-tensor node (computed by the forward), a constant or none
    divide: bool                      # scores / scale instead of * scale
    act: str                          # softmax | relu
    out: Node                         # the second matmul: the span's one escaping value


def _is_call(n: Any, fns: tuple, method: str) -> bool:
    if not isinstance(n, Node):
        return False
    if n.op == "call_function" and n.target in fns:
        return True
    return n.op == "call_method" and n.target == method


def _matmul_of(n: Any, infos: dict[Node, OpInfo]) -> bool:
    return isinstance(n, Node) and infos[n].kind == "library" and infos[n].op == "matmul" \
        and len(n.args) == 2 and not n.kwargs and all(isinstance(a, Node) for a in n.args)


def _scalar_node(n: Any) -> bool:
    return isinstance(n, Node) and shape_of(n) is None and n.meta.get("tensor_meta") is None \
        and n.op != "placeholder"


def _match(m2: Node, infos: dict[Node, OpInfo]) -> Optional[Span]:
    if not _matmul_of(m2, infos):
        return None
    nodes: list[Node] = [m2]
    a = m2.args[0]
    while infos[a].kind == "alias" and isinstance(infos[a].operands[0], Node):
        if infos[a].mutates is not None:
            return None
        nodes.append(a)
        a = infos[a].operands[0]
    info = infos[a]
    if info.kind == "reduce" and info.op == "softmax":
        act = "softmax"
        if info.params.get("dims") != [len(shape_of(a)) - 1]:
            return None
    elif info.kind == "ew" and info.op == "relu" and info.mutates is None:
        act = "relu"
    else:
        return None
    nodes.append(a)
    x = info.operands[0]
    mask = None
    if _is_call(x, (torch.masked_fill,), "masked_fill"):
        if len(x.args) != 3 or x.kwargs:
            return None
        s, cond, fill = x.args
        if not (isinstance(fill, (int, float)) and math.isinf(fill) and fill < 0):
            return None
        if not (_is_call(cond, _EQ, "eq") and len(cond.args) == 2 and isinstance(cond.args[0], Node)
                and isinstance(cond.args[1], (int, float)) and cond.args[1] == 0):
            return None
        mask = cond.args[0]
        nodes += [x, cond]
        x = s
    scale: Union[Node, float, None] = None
    divide = False
    if _is_call(x, _MUL, "mul") and len(x.args) == 2 and not x.kwargs:
        s0, s1 = x.args
        m1, scale = (s0, s1) if _matmul_of(s0, infos) else (s1, s0)
        nodes.append(x)
    elif _is_call(x, _DIV, "div") and len(x.args) == 2 and not x.kwargs:
        m1, scale = x.args
        divide = True
        nodes.append(x)
    else:
        m1 = x
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) or _scalar_node(scale) or scale is None):
        return None
    if not _matmul_of(m1, infos):
        return None
    q, kt = m1.args
    nodes.append(m1)
    if not (_is_call(kt, (torch.transpose,), "transpose") and len(kt.args) == 3 and isinstance(kt.args[0], Node)):
        return None
    rank = len(shape_of(kt) or ())
    if rank != 4 or {int(d) % 4 for d in kt.args[1:]} != {2, 3}:
        return None
    k = kt.args[0]
    nodes.append(kt)
    v = m2.args[1]
    return Span(nodes=nodes, q=q, k=k, v=v, mask=mask, scale=scale, divide=divide, act=act, out=m2)


def _valid(sp: Span, infos: dict[Node, OpInfo]) -> bool:
    shapes = [shape_of(t) for t in (sp.q, sp.k, sp.v)]
    if any(s is None or len(s) != 4 for s in shapes):
        return False
    (b, h, t, d), (b2, h2, s, d2), (b3, h3, s3, e) = shapes
    if (b, h) != (b2, h2) or (b, h) != (b3, h3) or d != d2 or s != s3:
        return False
    if max(d, e) > MAX_HEAD_DIM or min(t, s, d, e) < 1:
        return False
    dtypes = {value_dtype(x) for x in (sp.q, sp.k, sp.v, sp.out)}
    if len(dtypes) != 1 or not supported(next(iter(dtypes))):
        return False
    if sp.mask is not None:
        ms = shape_of(sp.mask)
        if ms is None or len(ms) > 4 or not supported(value_dtype(sp.mask)):
            return False
        al = (1,) * (4 - len(ms)) + tuple(ms)
        if any(m not in (1, full) for m, full in zip(al, (b, h, t, s))):
            return False
    inside = set(sp.nodes)
    # every intermediate is used only inside the span (its output may be used anywhere)
    return all(set(effective_users(n, infos)) <= inside for n in sp.nodes if n is not sp.out)


def find(gm_nodes: list[Node], infos: dict[Node, OpInfo], blocked: set[str]) -> list[Span]:
    """Every attention span of the graph, in graph order, none touching a ``blocked`` node name
    (left to PyTorch, or a cut the feedback set)."""
    order = {n: i for i, n in enumerate(gm_nodes)}
    spans: list[Span] = []
    taken: set[Node] = set()
    for n in gm_nodes:
        sp = _match(n, infos) if n.op in ("call_function", "call_method") else None
        if sp is None or not _valid(sp, infos):
            continue
        if any(x.name in blocked for x in sp.nodes) or taken & set(sp.nodes):
            continue
        sp.nodes.sort(key=order.__getitem__)
        taken |= set(sp.nodes)
        spans.append(sp)
    return spans


# --------------------------------------------------------------------------------------
# code generation
# --------------------------------------------------------------------------------------
class _Input:
    def __init__(self, index: int, value: Node):
        self.index, self.value = index, value

    @property
    def py(self) -> str:
        from agent.builtin.pysource import var
        return var(self.value)

    @property
    def dtype(self):
        return value_dtype(self.value)


class AttnKernel:
    """The kernel-group view of one span, as codegen, feedback, replay and the header read it."""

    kind = "attention"

    def __init__(self, span: Span, index: int, infos: dict[Node, OpInfo]):
        self.span = span
        self.name = f"kl_g{index}"
        self.nodes = span.nodes
        self.out_node = span.out
        self.out_dtype = value_dtype(span.out)
        self.ops = ["attention_" + span.act]
        self.infos = infos
        values = [span.q, span.k, span.v] + ([span.mask] if span.mask is not None else [])
        if isinstance(span.scale, Node):
            values.append(span.scale)
        self.inputs = [_Input(i, v) for i, v in enumerate(values)]
        self.tensor_inputs = self.inputs[:4 if span.mask is not None else 3]

    @property
    def dtypes(self) -> set:
        return {i.dtype for i in self.tensor_inputs} | {self.out_dtype}

    @property
    def has_half(self) -> bool:
        return any(is_half(d) for d in self.dtypes)

    def describe(self) -> str:
        sp = self.span
        scale = "" if sp.scale is None else (" / scale" if sp.divide else " * scale")
        mask = ", masked_fill(mask == 0, -inf)" if sp.mask is not None else ""
        return f"attention (q @ k^T{scale}{mask}, {sp.act}, @ v) in one kernel"

    def emulate(self, args: list[Any]) -> torch.Tensor:
        """What the kernel computes, in float64, rounded once to the output's dtype (q's at run
        time: the replay runs whole models in float64 too) - the replay's ``plan`` mode."""
        sp = self.span
        dtype = args[0].dtype
        q, k, v = (a.double() for a in args[:3])
        s = q @ k.transpose(-2, -1)
        scale = args[len(self.tensor_inputs)] if isinstance(sp.scale, Node) else sp.scale
        if scale is not None:
            s = s / float(scale) if sp.divide else s * float(scale)
        if sp.mask is not None:
            s = s.masked_fill(args[3] == 0, float("-inf"))
        p = torch.softmax(s, -1) if sp.act == "softmax" else torch.relu(s)
        return (p @ v).to(dtype)


class AttnCode:
    """GroupCode's interface for one attention kernel: its source, wrapper and Python call."""

    def __init__(self, kg: AttnKernel, device: str, knobs: Any):
        self.kg = kg
        self.device = device
        self.knobs = knobs

    @property
    def uses_knobs(self) -> set[str]:
        return {"attention"}

    def summary_line(self) -> str:
        """The candidate's docstring line for this kernel (GroupCode's interface)."""
        kg = self.kg
        causal = ("the mask is checked on the device each call; where it is zero above the diagonal (causal) "
                  "the keys after each query are skipped") if kg.span.mask is not None else "no mask"
        return (f"{kg.name}: {kg.describe()} (nodes {', '.join(n.name for n in kg.nodes)}): flash-style, the "
                f"scores never stored, float32 accumulation; {causal}. The QKV and output GEMMs stay on the library.")

    def kernel_source(self) -> str:
        from agent.builtin.codegen import render

        kg = self.kg
        ctx = dict(name=kg.name, describe=kg.describe(), softmax=kg.span.act == "softmax",
                   has_mask=kg.span.mask is not None, qt=c_type(kg.inputs[0].dtype),
                   mt=c_type(value_dtype(kg.span.mask)) if kg.span.mask is not None else "float",
                   ot=c_type(kg.out_dtype), head_dims=HEAD_DIMS)
        if self.device == "cuda":
            return render("cuda_attn.cu.j2", bm=64, bn=32, **ctx)
        return render("cpu_attn.cpp.j2", **ctx)

    def wrapper(self) -> dict[str, Any]:
        kg, sp = self.kg, self.kg.span
        dev = "t0.is_cuda()" if self.device == "cuda" else "t0.device().is_cpu()"
        lines = [
            "auto chk = [&](const torch::Tensor& t, at::ScalarType want, const char* what) {",
            "  TORCH_CHECK(t.defined(), who, \": \", what, \" is undefined\");",
            "  TORCH_CHECK(t.scalar_type() == want, who, \": \", what, \" must be \", want, \", got \", t.scalar_type());",
            f"  TORCH_CHECK({dev.replace('t0', 't')}, who, \": \", what, \" is on the wrong device\");",
            "};",
        ]
        names = ["q", "k", "v", "mask"]
        for i in kg.tensor_inputs:
            lines.append(f'chk(t{i.index}, {at_type(i.dtype)}, "{names[i.index]}");')
        lines += [
            'TORCH_CHECK(t0.dim() == 4 && t1.dim() == 4 && t2.dim() == 4, who, ": q, k and v must be 4-d");',
            "const int64_t B = t0.size(0), H = t0.size(1), T = t0.size(2), D = t0.size(3);",
            "const int64_t S = t1.size(2), E = t2.size(3);",
            'TORCH_CHECK(t1.size(0) == B && t1.size(1) == H && t1.size(3) == D, who, ": k does not match q");',
            'TORCH_CHECK(t2.size(0) == B && t2.size(1) == H && t2.size(2) == S, who, ": v does not match k");',
            f'TORCH_CHECK(D <= {MAX_HEAD_DIM} && E <= {MAX_HEAD_DIM}, who, ": head dims above {MAX_HEAD_DIM}");',
            "std::vector<long long> meta{(long long)B, (long long)H, (long long)T, (long long)S, (long long)D, (long long)E};",
            "for (const torch::Tensor* t : {&t0, &t1, &t2}) for (int d = 0; d < 4; ++d) meta.push_back((long long)t->stride(d));",
        ]
        if sp.mask is not None:
            lines += [
                "torch::Tensor m4 = t3;",
                "while (m4.dim() < 4) m4 = m4.unsqueeze(0);",
                'TORCH_CHECK(m4.dim() == 4, who, ": the mask has more than 4 dims");',
                "torch::Tensor me = m4.expand({B, H, T, S});",
                "for (int d = 0; d < 4; ++d) meta.push_back((long long)me.stride(d));",
                "for (int d = 0; d < 4; ++d) meta.push_back((long long)m4.size(d));",
                "meta.push_back((m4.size(3) == 1 && S > 1) ? 0 : 1);   // a causal mask is possible",
            ]
        else:
            lines.append("for (int d = 0; d < 9; ++d) meta.push_back(0);")
        lines += [
            f"meta.push_back({1 if sp.divide else 0});",
            f"torch::Tensor out = torch::empty({{B, H, T, E}}, t0.options().dtype({at_type(kg.out_dtype)}));",
            "torch::Tensor flag = torch::ones({1}, t0.options().dtype(at::kInt));",
        ]
        if isinstance(sp.scale, Node):
            fmeta = "scale"
        else:
            fmeta = repr(float(sp.scale)) if sp.scale is not None else "1.0"
        sig = [f"torch::Tensor t{i.index}" for i in kg.tensor_inputs]
        if isinstance(sp.scale, Node):
            sig.append("double scale")
        ptrs = ", ".join(f"t{i.index}.data_ptr<{c_type(i.dtype)}>()" for i in kg.tensor_inputs)
        if sp.mask is None:
            ptrs += ", nullptr"
        return {"name": kg.name, "describe": kg.describe().replace('"', "'"), "signature": ", ".join(sig),
                "body": lines, "in_ptrs": ptrs,
                "out_ptr": f"out.data_ptr<{c_type(kg.out_dtype)}>(), flag.data_ptr<int>()", "fmeta": fmeta}

    def python_call(self) -> list[str]:
        from agent.builtin.pysource import var

        kg = self.kg
        args = [i.py for i in kg.tensor_inputs]
        if isinstance(kg.span.scale, Node):
            args.append(f"float({var(kg.span.scale)})")
        return [f"{var(kg.out_node)} = _ext.{kg.name}({', '.join(args)})"]


def codes(spans: list[Span], first_index: int, infos: dict[Node, OpInfo], device: str, knobs: Any) -> list[AttnCode]:
    return [AttnCode(AttnKernel(sp, first_index + i, infos), device, knobs) for i, sp in enumerate(spans)]


__all__ = ["Span", "AttnKernel", "AttnCode", "find", "codes", "ATTENTION_MODES"]
