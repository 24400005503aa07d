"""Kernels that give PyTorch's own bits: where the plan replay (``agent.builtin.replay``) finds a
reference so ill-conditioned that it accepts nothing but PyTorch's own rounding (level3/10_ResNet101
in TF32), only groups whose kernels compute exactly what PyTorch's kernels compute keep them:
selections, max pools and single IEEE-754 operations of float32 values, with no multiply and add in
one kernel (docs/builtin_replay.md)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

# operators that select or copy a value and never round: any implementation gives PyTorch's bits
_EXACT = {"copy", "relu", "neg", "abs", "clamp_min", "clamp_max", "clamp", "hardtanh", "maximum", "minimum", "masked_fill"}
# one IEEE-754 basic operation of two float32 values: correctly rounded in PyTorch's CPU and CUDA
# kernels (add and sub as a + 1 * b, exact in either order or fused; div as a / b where the divisor
# is a tensor) and in the generated kernels (``c_expr.BINARY``: `(a + b)` in float, each node's
# result a `const float`; nvcc's default -prec-div=true, no fast-math anywhere)
_IEEE = {"add", "sub", "mul", "div"}
# ... as long as no multiply and add share a kernel: nvcc contracts `a * b + c` into an FMA by default
# (--fmad=true; the candidates build with -O3 only: templates/candidate.py.j2), and so does GCC in
# the AVX-512 clone of every CPU kernel (templates/common.h.j2: target_clones("avx512f", ...);
# AVX-512F has FMA and GCC's C++ default is -ffp-contract=fast). An FMA rounds once where PyTorch,
# one kernel per operator, rounds twice. (Division counts as a multiply: a compiler may turn a
# division by a power of two into a multiply.)
_PRODUCTS = {"mul", "div"}
_SUMS = {"add", "sub"}


def _f32_exact(v: Any) -> bool:
    """Whether the number ``v`` is a float32 value: its literal (``c_expr.c_float``: the shortest
    decimal of the double, read by the compiler as a float) is then the float32 PyTorch computes
    with ((float)(double)v). Other values could round twice, to a neighbour."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return float(torch.tensor(float(v), dtype=torch.float32).item()) == float(v)
    except (OverflowError, RuntimeError):
        return False


def _pow2(v: Any) -> bool:
    """Whether ``v`` is a (signed) power of two whose reciprocal is a normal float32: 1/v is then
    exact, so PyTorch's CUDA division by a number, ``a * (1 / v)``, is the correctly rounded
    ``a / v`` (the same real number, rounded once)."""
    if not _f32_exact(v) or not v or not math.isfinite(float(v)):
        return False
    m, e = math.frexp(abs(float(v)))
    return m == 0.5 and -125 <= e <= 127          # |v| = 2^(e-1), 2^-126 .. 2^126


def _f32_tensor(o: Any) -> bool:
    tm = o.meta.get("tensor_meta") if isinstance(o, Node) else None
    return getattr(tm, "dtype", None) == torch.float32


def node_gives_pytorch_bits(n: Node, info: Any) -> bool:
    """Whether a kernel computes node ``n`` (``info``: its plan's reading) bit for bit as PyTorch
    does, given the same inputs: a selection, a max pooling, or one IEEE operation of float32
    tensors and float32-exact numbers."""
    if info.kind == "ew" and info.op in _EXACT:
        return True
    if info.kind == "pool":
        return info.op in ("max_pool2d", "max_pool3d")
    if info.kind != "ew" or info.op not in _IEEE or not _f32_tensor(n) or len(info.operands) != 2:
        return False
    a, b = info.operands
    for o in (a, b):
        if isinstance(o, Node):
            if not _f32_tensor(o):          # (an int from a size, a double buffer: another promotion)
                return False
        elif not _f32_exact(o):
            return False
    if info.op == "div":
        # `2.0 / x` is PyTorch's reciprocal(x) * 2.0 (two roundings); a CUDA division by a number
        # (or a 0-d CPU tensor) multiplies by its reciprocal (BinaryDivTrueKernel.cu)
        if not isinstance(a, Node):
            return False
        if isinstance(b, Node):
            return len(getattr(b.meta.get("tensor_meta"), "shape", ())) > 0
        return _pow2(b)
    return True


def gives_pytorch_bits(kg: Any, infos: dict[Node, Any]) -> bool:
    """Whether the kernel of group ``kg`` computes PyTorch's own bits: an elementwise chain or a
    max pool (with its prologue and epilogue), each node a selection or one IEEE operation
    (``node_gives_pytorch_bits``), with no multiply and add in one kernel (an FMA: see ``_PRODUCTS``).
    A lone operator counts: its kernel alone only matches PyTorch's, but it is the candidate's own
    work inside the CUDA graph that replays the rest (``graphed.py``; MobileNets and EfficientNetB2,
    whose batch norms at batch 2-10 accept nothing but PyTorch's bits, keep their ReLUs and adds)."""
    if kg.kind not in ("ew", "pool") or not kg.nodes:
        return False
    if not all(node_gives_pytorch_bits(n, infos[n]) for n in kg.nodes):
        return False
    ops = {infos[n].op for n in kg.nodes}
    return not (ops & _PRODUCTS and ops & _SUMS)
