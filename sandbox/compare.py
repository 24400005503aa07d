"""Comparing candidate outputs with reference outputs, in the parent process.

The candidate never runs in this process, so it cannot patch what decides its verdict.
Policy: the same number of outputs; identical shapes and dtypes; every element within
``atol + rtol * |ref|`` (float32 and wider: ``EvalConfig.tol_fp32``, half types:
``tol_half``); NaN or Inf where the reference is finite fails; non-finite reference
elements must be matched exactly (NaN with NaN, +Inf with +Inf).
"""
from __future__ import annotations

from typing import Optional

import torch

from sandbox.result import EvalConfig, OutputCheck, Tolerance

HALF_TYPES = (torch.float16, torch.bfloat16)
_BLOCKS = (16, 32, 64, 128, 256, 512, 1024)


def tolerance_for(dtype: torch.dtype, config: EvalConfig) -> Tolerance:
    return config.tol_half if dtype in HALF_TYPES else config.tol_fp32


def _pattern(bad: torch.Tensor) -> tuple[str, Optional[list[int]]]:
    """Where mismatches sit: everywhere, some rows, tile edges (a tail past a block multiple), scattered."""
    n_bad, numel = int(bad.sum()), bad.numel()
    rows = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() >= 1 and bad.shape[0] else bad.reshape(1)
    bad_rows = torch.nonzero(rows).flatten()[:8].tolist()
    if n_bad >= 0.5 * numel:
        return "everywhere", bad_rows
    if bad.dim() >= 1 and bad.shape[-1] > 1:
        last = bad.shape[-1]
        cols = torch.nonzero(bad.reshape(-1, last).any(dim=0)).flatten()
        first_bad_col = int(cols.min())
        for b in reversed(_BLOCKS):
            edge = (last // b) * b
            if 0 < edge < last and first_bad_col >= edge:
                return "tile_edges", bad_rows
    if bad.dim() >= 1 and bad.shape[0] > 1 and int(rows.sum()) <= 0.5 * rows.numel():
        return "some_rows", bad_rows
    return "scattered", bad_rows


def compare_tensor(index: int, ref: torch.Tensor, out: torch.Tensor, config: EvalConfig) -> OutputCheck:
    tol = tolerance_for(ref.dtype, config)
    check = OutputCheck(index=index, shape=list(out.shape), dtype=str(out.dtype).replace("torch.", ""),
                        ref_shape=list(ref.shape), ref_dtype=str(ref.dtype).replace("torch.", ""),
                        numel=ref.numel(), tolerance=tol)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return check
    if ref.numel() == 0:
        return check
    if not (ref.dtype.is_floating_point or ref.dtype.is_complex):
        diff_mask = out != ref
        check.mismatched = int(diff_mask.sum())
        check.max_abs_err = float((out.double() - ref.double()).abs().max())
        check.max_rel_err = check.max_abs_err
        if check.mismatched:
            check.mismatch_pattern, check.bad_rows = _pattern(diff_mask)
        return check
    r, o = ref.double(), out.double()
    ref_finite = torch.isfinite(r)
    check.nan_count = int((torch.isnan(o) & ref_finite).sum())
    check.inf_count = int((torch.isinf(o) & ref_finite).sum())
    check.ref_nonfinite = int((~ref_finite).sum())
    nonfinite_mismatch = ~ref_finite & ~((torch.isnan(r) & torch.isnan(o)) | (r == o))
    diff = (o - r).abs()
    diff = torch.where(ref_finite, diff, torch.zeros_like(diff))
    diff = torch.nan_to_num(diff, nan=float("inf"))
    bad = (diff > tol.atol + tol.rtol * r.abs().nan_to_num(posinf=0.0, neginf=0.0)) | nonfinite_mismatch
    finite_diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
    check.max_abs_err = float(diff.max())
    rel = finite_diff / r.abs().clamp_min(1e-12)
    rel = torch.where(ref_finite, rel, torch.zeros_like(rel))
    check.max_rel_err = float(rel.max()) if not torch.isinf(diff).any() else float("inf")
    check.mismatched = int(bad.sum())
    if check.mismatched:
        check.mismatch_pattern, check.bad_rows = _pattern(bad)
    return check


def compare_outputs(ref: list[torch.Tensor], out: list[torch.Tensor],
                    config: EvalConfig) -> tuple[bool, Optional[str], list[OutputCheck]]:
    """Return (passed, reason for failure in words, per-output checks)."""
    if len(ref) != len(out):
        return False, f"the candidate returned {len(out)} output(s), the reference {len(ref)}", []
    checks: list[OutputCheck] = []
    reason: Optional[str] = None
    for i, (r, o) in enumerate(zip(ref, out)):
        c = compare_tensor(i, r, o, config)
        checks.append(c)
        if reason:
            continue
        if c.shape != c.ref_shape:
            reason = f"output {i} has shape {tuple(c.shape)}, the reference {tuple(c.ref_shape)}"
        elif c.dtype != c.ref_dtype:
            reason = f"output {i} has dtype {c.dtype}, the reference {c.ref_dtype}"
        elif c.nan_count or c.inf_count:
            reason = (f"output {i} has {c.nan_count} NaN and {c.inf_count} Inf where the reference is finite")
        elif c.mismatched:
            reason = (f"output {i}: {c.mismatched} of {c.numel} elements outside atol={c.tolerance.atol:g}, "
                      f"rtol={c.tolerance.rtol:g} (max abs error {c.max_abs_err:.3g}, "
                      f"max rel error {c.max_rel_err:.3g}, {c.mismatch_pattern})")
    return reason is None, reason, checks
