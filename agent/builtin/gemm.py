"""Library GEMMs the builtin runs as split-TF32 tensor-core GEMMs (the ``matmul`` knob, ``tc3``).

Every float32 operand ``v`` is split into ``big`` (``v`` rounded to TF32: round to nearest at
mantissa bit 13) and ``small = v - big`` (exact in float32). With cuBLAS's TF32 mode on for
these calls only, the product is

    y  = bias + xs @ wb.T + xb @ ws.T       (one GEMM over the concatenated operands, K' = 2K)
    y += xb @ wb.T                          (in K-chunks of 256, one addmm_ per chunk)

``xs @ ws.T`` (about 2^-22 of the product) is dropped. Inf and NaN go wholly into the small
part (big = 0), so that they meet only the other operand's big part, which carries the other
value's sign: an Inf in x gives +-Inf as in the reference, not Inf - Inf = NaN. Each chunk's tensor-core result is added
into ``y`` by cuBLAS's float32 epilogue with round-to-nearest, so the tensor cores' truncating
accumulation never runs over more than 256 products. The generated candidate calls
``_ext.kl_tc_linear(x, weight, bias, keep_split)`` / ``_ext.kl_tc_matmul(a, b)`` (``templates/tc_gemm.cpp.j2``
and the split kernel in ``templates/cuda_tc.cu.j2``; ``kl_tc_linear`` keeps each weight's split
until that weight changes); ``matmul="ieee"`` keeps PyTorch's own
float32 call. Only ``cuda`` uses it, and only under the ``fp32`` precision: under ``fp16`` and
``bf16`` the model's GEMMs are half-precision GEMMs and stay on PyTorch as they are.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from agent.builtin.ops import OpInfo, shape_of, tensor_meta
from agent.builtin.pysource import attr_path, fmt

MATMUL_MODES = ("tc3", "ieee")
TC3_MIN_K = 1024
TC3_MIN_N = 256
TC3_MIN_MNK = 2 ** 33
# The split re-reads and re-writes both operands (the weight too, every call) and adds K/256
# chunked GEMMs: work proportional to N*K, against a GEMM of M*N*K. With few rows (1_MLP: M=128,
# N=K=16384) that overhead is the GEMM's own size and the candidate ran 0.66x eager on an H200:
# below this many rows cuBLAS's single SGEMM stays. At 2048 rows (level2/51 and 53, N=K=8192)
# the split ran 1.6x torch.compile on an H200 (session u), while the 24 level-2 GEMMs of 1024
# rows and the same N and K, then below the bound, stayed at cuBLAS's 1.00x: at half the rows
# the weight's split is 2x as large a share (about 0.16 ms of 1.3 ms), so 1024 rows qualify.
TC3_MIN_M = 1024
# An nn.Linear's weight is split once and kept (``kl_tc_linear``'s cache in templates/tc_gemm.cpp.j2,
# re-split when the parameter changes: another tensor, another address, or its version counter
# bumped by an in-place write), so a call pays for the input's split and the GEMMs only. Its
# GEMMs then read the weight three times over (the K' = 2K GEMM reads both halves, the chunks
# the big half again) where SGEMM reads it once but runs at float32's rate: for N = K = 16384 the
# three reads are about 0.7 ms on an H200 at 4.8 TB/s, SGEMM about 0.011 ms a row (1_MLP's 128 rows:
# about 1.4 ms), so they cross near 64 rows; 128 rows keeps a margin (an estimate from the
# GPU's rates, measured on level3/1-3 in session z's run).
TC3_MIN_M_CACHED = 128
_MATMUL_FUNCTIONS = (torch.matmul, torch.mm, operator.matmul)
_MATMUL_METHODS = ("matmul", "mm")


def tc3_worthwhile(device: str, m: int, n: int, k: int, cached_weight: bool = False) -> bool:
    """Whether an [M, K] x [K, N] float32 GEMM runs as split-TF32 GEMMs (``tc3``).

    Measured on an H200 against a float64 result: for 8192x4096x4096 (M x N x K) cuBLAS's fp32
    SGEMM took 5.42 ms with a relative RMS error of 1.13e-6 (max relative 2.6e-3); the split
    took 3.51 ms at 6.3e-7 (max relative 9.1e-4): as accurate there, 1.5x faster (at
    2048x4096x1024 its error was 1.12x SGEMM's, at 1024x768x2048 1.75x: inside the sandbox's 2x). For 16384x4096x512
    it was 1.32 ms against 1.42 ms, too small a gain for 17 extra GEMM calls and the split's
    memory traffic; a bmm with K=128 was slower (bmm is never offered). So only large GEMMs with
    a long K (enough 256-chunks to amortise the calls) and a wide N: K >= 1024, N >= 256 and
    M*N*K >= 2^33, on cuda only; and enough rows to amortise splitting the weight: M >= 1024
    (``TC3_MIN_M``), or ``TC3_MIN_M_CACHED`` where the weight is an ``nn.Linear``'s, whose split is
    kept across calls (``cached_weight``)."""
    rows = TC3_MIN_M_CACHED if cached_weight else TC3_MIN_M
    return (device == "cuda" and m >= rows and k >= TC3_MIN_K and n >= TC3_MIN_N
            and m * n * k >= TC3_MIN_MNK)


@dataclass
class TcGemm:
    """One library node the candidate computes with ``kl_tc_linear``/``kl_tc_matmul``."""
    node: Node
    fn: str                      # kl_tc_linear | kl_tc_matmul
    args: list[str]              # Python expressions of its arguments
    m: int
    n: int
    k: int
    kept: Optional[str] = None   # the weight whose split kl_tc_linear keeps across calls (an nn.Linear's)

    def statement(self) -> str:
        from agent.builtin.pysource import var
        return f"{var(self.node)} = _ext.{self.fn}({', '.join(self.args)})"

    def comment(self) -> str:
        kept = "; the weight's split kept while the weight is unchanged" if self.kept else ""
        return (f"# {self.node.name}: [{self.m}x{self.k}] x [{self.k}x{self.n}] float32 GEMM as split-TF32 "
                f"tensor-core GEMMs, K-chunked accumulation ({self.fn}; fp32-accurate{kept})")


def _f32_2d(node: Any) -> Optional[tuple[int, int]]:
    tm = tensor_meta(node)
    if tm is None or tm.dtype != torch.float32 or len(tm.shape) != 2:
        return None
    return int(tm.shape[0]), int(tm.shape[1])


def _input_mk(x: Any) -> Optional[tuple[int, int]]:
    """(M, K) of a float32 input [..., K] (M: the product of the leading dims)."""
    tm = tensor_meta(x)
    if tm is None or tm.dtype != torch.float32 or len(tm.shape) < 1:
        return None
    shape = shape_of(x)
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, shape[-1]


def _arg(node: Node, i: int, *names: str) -> Any:
    if len(node.args) > i:
        return node.args[i]
    for name in names:
        if name in node.kwargs:
            return node.kwargs[name]
    return None


def tc3_gemm(node: Node, info: OpInfo, modules: dict[str, nn.Module], device: str) -> Optional[TcGemm]:
    """The split-TF32 call for a library node, or None where it does not qualify: an ``nn.Linear``
    call, ``F.linear``, or a 2-D float32 ``torch.matmul``/``torch.mm``/``@`` ([M,K] x [K,N]),
    large enough for ``tc3_worthwhile``. bmm, convolutions and everything else: None."""
    if info.kind != "library" or device != "cuda" or not _out_f32(node):
        return None
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if type(mod) is not nn.Linear or len(node.args) + len(node.kwargs) != 1:
            return None
        x = _arg(node, 0, "input")
        w = mod.weight
        mk = _input_mk(x) if isinstance(x, Node) else None
        if mk is None or w.dtype != torch.float32 or w.dim() != 2 or int(w.shape[1]) != mk[1]:
            return None
        if mod.bias is not None and mod.bias.dtype != torch.float32:
            return None
        m, k = mk
        n = int(w.shape[0])
        path = attr_path(str(node.target))
        bias = f"{path}.bias" if mod.bias is not None else "None"
        return _if_worthwhile(node, "kl_tc_linear", [fmt(x), f"{path}.weight", bias, "True"], m, n, k, device,
                              kept=f"{path}.weight")
    if node.op == "call_function" and node.target is F.linear:
        if set(node.kwargs) - {"input", "weight", "bias"} or len(node.args) > 3:
            return None
        x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
        mk = _input_mk(x) if isinstance(x, Node) else None
        nk = _f32_2d(w) if isinstance(w, Node) else None
        if mk is None or nk is None or nk[1] != mk[1]:
            return None
        if b is not None:
            tb = tensor_meta(b)
            if tb is None or tb.dtype != torch.float32 or tuple(int(s) for s in tb.shape) != (nk[0],):
                return None
        return _if_worthwhile(node, "kl_tc_linear", [fmt(x), fmt(w), fmt(b), "False"], mk[0], nk[0], mk[1], device)
    is_fn = node.op == "call_function" and node.target in _MATMUL_FUNCTIONS
    is_method = node.op == "call_method" and node.target in _MATMUL_METHODS
    if (is_fn or is_method) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        ak, kn = _f32_2d(a), _f32_2d(b)
        if ak is None or kn is None or ak[1] != kn[0]:
            return None
        return _if_worthwhile(node, "kl_tc_matmul", [fmt(a), fmt(b)], ak[0], kn[1], ak[1], device)
    return None


def _out_f32(node: Node) -> bool:
    tm = tensor_meta(node)
    return tm is not None and tm.dtype == torch.float32


def _if_worthwhile(node: Node, fn: str, args: list[str], m: int, n: int, k: int, device: str,
                   kept: Optional[str] = None) -> Optional[TcGemm]:
    return TcGemm(node, fn, args, m, n, k, kept) if tc3_worthwhile(device, m, n, k, kept is not None) else None


def tc3_gemms(infos: dict[Node, OpInfo], modules: dict[str, nn.Module], device: str,
              precision: str = "fp32") -> list[TcGemm]:
    """Every library node of the graph that qualifies for ``tc3``, in graph order; none unless
    the run's precision is ``fp32`` (the split is of float32 operands; a half-precision GEMM
    stays on PyTorch)."""
    if precision != "fp32":
        return []
    out = []
    for node, info in infos.items():
        g = tc3_gemm(node, info, modules, device)
        if g is not None:
            out.append(g)
    return out
