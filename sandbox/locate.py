"""Computing a ``sandbox.locations.MismatchMap`` from the wrong-element mask, where outputs are compared.

Runs in the trusted reference worker, on the reference's device, only for failing outputs.
Every figure is a count or an index: the critic quotes them as the proof of a pattern.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from sandbox.locations import MAX_RUNS, AxisMap, MismatchMap, ValueMap
from sandbox.numerics import Tolerance

MAX_PERIOD = 256                 # longest period looked for along an axis
MAX_FLAT = 1 << 22               # wrong elements beyond which the memory-order step is not computed
MAX_TRANSPOSE = 1 << 24          # elements beyond which transposition is not tried


def _runs(counts: list[int]) -> tuple[list[list[int]], bool]:
    runs: list[list[int]] = []
    for i, c in enumerate(counts):
        if runs and runs[-1][2] == c and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            if len(runs) == MAX_RUNS:
                return runs, True
            runs.append([i, i + 1, c])
    return runs, False


def _period(counts: torch.Tensor) -> Optional[int]:
    """The smallest period of which indices hold wrong elements (a value that happens to be right
    does not break a pattern: the support repeats, not the exact counts)."""
    hot = counts > 0
    n = hot.numel()
    if n < 4 or bool((hot == hot[0]).all()):
        return None
    for k in range(2, min(MAX_PERIOD, n // 2) + 1):
        if n % k == 0 and bool((hot.view(n // k, k) == hot[:k]).all()):
            return k
    return None


def _axis(bad: torch.Tensor, d: int) -> AxisMap:
    size = bad.shape[d]
    counts = bad.movedim(d, 0).reshape(size, -1).sum(dim=1).cpu()
    runs, truncated = _runs(counts.tolist())
    period = _period(counts)
    return AxisMap(axis=d, size=size, slice_numel=bad.numel() // size if size else 0, runs=runs,
                   truncated=truncated, period=period,
                   period_counts=counts[:period].tolist() if period else [])


def _unravel(flat: int, shape: list[int]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return list(reversed(out))


def _flat_step(idx: torch.Tensor, numel: int) -> tuple[Optional[int], Optional[int], Optional[int]]:
    if idx.numel() < 2 or idx.numel() > MAX_FLAT:
        return None, None, None
    diffs = (idx[1:] - idx[0]).cpu()
    g = 0
    for v in torch.unique(diffs).tolist():       # few distinct differences in a regular pattern
        g = math.gcd(g, int(v))
        if g == 1:
            return None, None, None
    offset = int(idx[0]) % g
    slots = (numel - offset + g - 1) // g
    return g, offset, slots


def _values(bad: torch.Tensor, ref: torch.Tensor, out: torch.Tensor, tol: Tolerance) -> ValueMap:
    r, o = ref[bad].double(), out[bad].double()
    finite = torch.isfinite(r) & torch.isfinite(o)
    r, o = r[finite], o[finite]
    vm = ValueMap(wrong_finite=int(r.numel()))
    if not r.numel():
        return vm
    vm.sign_flips = int(((o + r).abs() <= tol.atol + tol.rtol * r.abs()).sum())
    big = r.abs() > max(10 * tol.atol, 1e-6)
    if bool(big.any()):
        ratio = o[big] / r[big]
        vm.ratio_count, vm.ratio_min, vm.ratio_max = int(ratio.numel()), float(ratio.min()), float(ratio.max())
    return vm


def _close(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= tol.atol + tol.rtol * b.abs()).all())


def _transposed(ref: torch.Tensor, out: torch.Tensor, tol: Tolerance) -> Optional[str]:
    if ref.dim() < 2 or ref.numel() > MAX_TRANSPOSE or not ref.dtype.is_floating_point:
        return None
    h, w = ref.shape[-2], ref.shape[-1]
    if h == w and _close(out, ref.transpose(-1, -2), tol):
        return "axes"
    lead = list(ref.shape[:-2])
    if h != w and _close(out.reshape(*lead, w, h).transpose(-1, -2), ref, tol):
        return "layout"
    if h == w and _close(out.reshape(*lead, w, h).transpose(-1, -2), ref, tol):
        return "axes"
    return None


def mismatch_map(bad: torch.Tensor, ref: torch.Tensor, out: torch.Tensor, tol: Tolerance) -> MismatchMap:
    """The map of ``bad`` (a boolean mask shaped like ``ref``) with the values that prove its pattern."""
    shape = list(ref.shape)
    wrong = int(bad.sum())
    m = MismatchMap(shape=shape, wrong=wrong)
    if wrong == 0:
        return m
    m.axes = [_axis(bad, d) for d in range(bad.dim())]
    flat_bad = bad.reshape(-1)
    idx = torch.nonzero(flat_bad).flatten() if wrong <= MAX_FLAT else None
    first = int(idx[0]) if idx is not None else int(torch.argmax(flat_bad.to(torch.uint8)))
    m.first_wrong = _unravel(first, shape)
    if idx is not None:
        m.flat_step, m.flat_offset, m.flat_slots = _flat_step(idx, bad.numel())
    if ref.dtype.is_floating_point:
        nonfinite = ~torch.isfinite(out) & torch.isfinite(ref)
        m.nonfinite = int(nonfinite.sum())
        if m.nonfinite:
            m.first_nonfinite = _unravel(int(torch.argmax(nonfinite.reshape(-1).to(torch.uint8))), shape)
        m.values = _values(bad, ref, out, tol)
        m.values.transposed = _transposed(ref, out, tol)
    return m
