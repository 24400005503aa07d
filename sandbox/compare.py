"""Comparing candidate outputs with reference outputs, in the trusted reference worker.

The candidate never runs in that process, so it cannot patch what decides its verdict; the
comparison runs on the reference's device (a gigabyte-sized output is compared in
milliseconds on a GPU, in seconds on a CPU).
Policy (``sandbox.numerics``): the same number of outputs; identical shapes and dtypes; every
element within ``atol + rtol * |ref|`` of the reference (the precision's tolerance), or, by the
float64 rule, within ``elem_factor * E + atol + rtol * |ref64|`` of the reference run in
float64, where ``E`` is the reference's own largest distance from that run; NaN or Inf where
the reference is finite fails; non-finite reference elements must be matched exactly (NaN
with NaN, +Inf with +Inf).
"""
from __future__ import annotations

from typing import Optional

import torch

from sandbox.locate import mismatch_map
from sandbox.numerics import Numerics, Tolerance
from sandbox.result import EvalConfig, OutputCheck

_BLOCKS = (16, 32, 64, 128, 256, 512, 1024)
CHUNK = 1 << 22                                  # elements compared at a time


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


def _chunk_len(device: torch.device) -> int:
    return CHUNK if device.type == "cpu" else CHUNK * 16      # a GPU wants bigger pieces


class Fp64Bound:
    """The float64 rule for one output: the reference run in float64 and the slack it allows,
    ``elem_factor`` times the reference's largest distance from it (``E``)."""

    def __init__(self, ref64: torch.Tensor, ref_max_abs: float, numerics: Numerics):
        self.ref64, self.ref_max_abs = ref64.reshape(-1), ref_max_abs
        self.slack = numerics.elem_factor * ref_max_abs

    def still_bad(self, lo: int, hi: int, o: torch.Tensor, bad: torch.Tensor, tol: Tolerance) -> torch.Tensor:
        """Of the elements ``bad`` marks in chunk ``[lo, hi)``, those also outside the float64 bound
        (NaN anywhere stays bad)."""
        x = self.ref64[lo:hi].to(o.device)
        within = (o - x).abs() <= self.slack + tol.atol + tol.rtol * x.abs()
        return bad & ~within


def compare_tensor(index: int, ref: torch.Tensor, out: torch.Tensor, config: EvalConfig,
                   fp64: Optional[Fp64Bound] = None) -> OutputCheck:
    tol = config.numerics.tolerance
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
            check.locations = mismatch_map(diff_mask, ref, out, tol)
        return check
    # In chunks: a float64 copy of a 1 GB output and a dozen temporaries of that size cost tens
    # of seconds of page faults (and tens of GB) per comparison; chunks reuse a few MB.
    flat_r, flat_o = ref.reshape(-1), out.reshape(-1)
    numel = flat_r.numel()
    chunk = _chunk_len(ref.device)
    bad_all: Optional[torch.Tensor] = None
    max_abs = max_rel = 0.0
    any_inf_diff = False
    mismatched = outside = 0
    counts = {"nan": 0, "inf": 0, "ref_nonfinite": 0}
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        r, o = flat_r[lo:hi].double(), flat_o[lo:hi].double()
        if bool(torch.isfinite(r).all()) and bool(torch.isfinite(o).all()):
            # the common case, in a third of the passes
            diff = (o - r).abs()
            r_abs = r.abs()
            bad = diff > r_abs * tol.rtol + tol.atol
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / r_abs.clamp_min_(1e-12)).max()))
        else:
            bad, chunk_abs, chunk_rel, inf_diff = _slow_chunk(r, o, tol, counts)
            max_abs, max_rel = max(max_abs, chunk_abs), max(max_rel, chunk_rel)
            any_inf_diff = any_inf_diff or inf_diff
        n_bad = int(bad.sum())
        outside += n_bad
        if n_bad and fp64 is not None:
            bad = fp64.still_bad(lo, hi, o, bad, tol)
            n_bad = int(bad.sum())
        if n_bad:
            mismatched += n_bad
            if bad_all is None:
                bad_all = torch.zeros(numel, dtype=torch.bool, device=ref.device)
            bad_all[lo:hi] = bad
    check.nan_count, check.inf_count, check.ref_nonfinite = counts["nan"], counts["inf"], counts["ref_nonfinite"]
    check.max_abs_err = max_abs
    check.max_rel_err = float("inf") if any_inf_diff else max_rel
    check.mismatched = mismatched
    check.outside_tolerance = outside
    if fp64 is not None:
        check.ref_fp64_max_abs = fp64.ref_max_abs
    if bad_all is not None:
        check.mismatch_pattern, check.bad_rows = _pattern(bad_all.reshape(ref.shape))
        check.locations = mismatch_map(bad_all.reshape(ref.shape), ref, out, tol)
    return check


def _slow_chunk(r: torch.Tensor, o: torch.Tensor, tol: Tolerance,
                counts: dict[str, int]) -> tuple[torch.Tensor, float, float, bool]:
    """A chunk with NaN or Inf on either side: adds them to ``counts``; returns the mismatch
    mask, the largest absolute and relative errors, and whether an error is infinite."""
    ref_finite = torch.isfinite(r)
    counts["nan"] += int((torch.isnan(o) & ref_finite).sum())
    counts["inf"] += int((torch.isinf(o) & ref_finite).sum())
    counts["ref_nonfinite"] += int((~ref_finite).sum())
    nonfinite_mismatch = ~ref_finite & ~((torch.isnan(r) & torch.isnan(o)) | (r == o))
    diff = (o - r).abs()
    diff = torch.where(ref_finite, diff, torch.zeros_like(diff))
    diff = torch.nan_to_num(diff, nan=float("inf"))
    bad = (diff > tol.atol + tol.rtol * r.abs().nan_to_num(posinf=0.0, neginf=0.0)) | nonfinite_mismatch
    finite_diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
    rel = finite_diff / r.abs().clamp_min(1e-12)
    rel = torch.where(ref_finite, rel, torch.zeros_like(rel))
    return bad, float(diff.max()), float(rel.max()), bool(torch.isinf(diff).any())


def compare_outputs(ref: list[torch.Tensor], out: list[torch.Tensor], config: EvalConfig,
                    bounds: Optional[list[Optional[Fp64Bound]]] = None) -> tuple[bool, Optional[str], list[OutputCheck]]:
    """Return (passed, reason for failure in words, per-output checks). ``bounds`` (one per
    output, from ``fp64_bounds``) applies the float64 rule to elements outside the tolerance."""
    if len(ref) != len(out):
        return False, f"the candidate returned {len(out)} output(s), the reference {len(ref)}", []
    checks: list[OutputCheck] = []
    reason: Optional[str] = None
    for i, (r, o) in enumerate(zip(ref, out)):
        c = compare_tensor(i, r, o, config, bounds[i] if bounds else None)
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
            rule = (f" and farther from float64 than {config.numerics.elem_factor:g}x the reference's "
                    f"{c.ref_fp64_max_abs:.3g}" if c.ref_fp64_max_abs is not None else "")
            reason = (f"output {i}: {c.mismatched} of {c.numel} elements outside atol={c.tolerance.atol:g}, "
                      f"rtol={c.tolerance.rtol:g}{rule} (max abs error {c.max_abs_err:.3g}, "
                      f"max rel error {c.max_rel_err:.3g}, {c.mismatch_pattern})")
    return reason is None, reason, checks


def only_value_mismatches(checks: list[OutputCheck]) -> bool:
    """Whether every failing output failed by values alone (same shape and dtype, no NaN or Inf
    where the reference is finite): the only failures the float64 rule can change."""
    failing = [c for c in checks if c.mismatched or c.nan_count or c.inf_count
               or c.shape != c.ref_shape or c.dtype != c.ref_dtype]
    return bool(failing) and all(c.shape == c.ref_shape and c.dtype == c.ref_dtype and not c.nan_count
                                 and not c.inf_count and c.mismatched for c in failing)


def fp64_bounds(ref: list[torch.Tensor], ref64: list[object], numerics: Numerics) -> list[Optional[Fp64Bound]]:
    """One ``Fp64Bound`` per output where the float64 rule applies (a float output whose float64
    run has its shape, with the reference close to it: ``Numerics.fp64_applies_below``)."""
    bounds: list[Optional[Fp64Bound]] = []
    for r, x in zip(ref, ref64):
        bound = None
        if (isinstance(x, torch.Tensor) and r.dtype.is_floating_point and x.dtype == torch.float64
                and x.shape == r.shape and r.numel()):
            errs = fp64_errors(r, r, x)
            if errs is not None and errs[0] <= numerics.fp64_applies_below:
                bound = Fp64Bound(x, _max_abs_finite(r, x), numerics)
        bounds.append(bound)
    return bounds


def _max_abs_finite(ref: torch.Tensor, ref64: torch.Tensor) -> float:
    """The largest ``|ref - ref64|`` over elements finite in both."""
    fr, fx = ref.reshape(-1), ref64.reshape(-1)
    chunk = _chunk_len(ref.device)
    best = 0.0
    for lo in range(0, fr.numel(), chunk):
        r, x = fr[lo:lo + chunk].double(), fx[lo:lo + chunk].to(ref.device)
        d = (r - x).abs()
        d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
        best = max(best, float(d.max()))
    return best


def fp64_errors(ref: torch.Tensor, out: torch.Tensor, ref64: torch.Tensor) -> Optional[tuple[float, float]]:
    """Relative RMS errors of the float32 reference and of the candidate against the reference
    run in float64: ``(ref_rel, cand_rel)``, each ``rms(x - ref64) / rms(ref64)`` over the
    elements all three hold finite. None where it does not apply (not floating point, other
    shapes, a float64 run that did not produce float64)."""
    if not (ref.dtype.is_floating_point and out.dtype == ref.dtype and ref64.dtype == torch.float64
            and ref.shape == out.shape == ref64.shape) or ref.numel() == 0:
        return None
    fr, fo, f64 = ref.reshape(-1), out.reshape(-1), ref64.reshape(-1)
    chunk = _chunk_len(ref.device)
    sq_ref = sq_out = sq_64 = 0.0
    for lo in range(0, fr.numel(), chunk):
        hi = min(fr.numel(), lo + chunk)
        r, o, x = fr[lo:hi].double(), fo[lo:hi].to(ref64.device).double(), f64[lo:hi]
        ok = torch.isfinite(r) & torch.isfinite(o) & torch.isfinite(x)
        if not bool(ok.all()):
            r, o, x = r[ok], o[ok], x[ok]
        sq_ref += float(((r - x) ** 2).sum())
        sq_out += float(((o - x) ** 2).sum())
        sq_64 += float((x * x).sum())
    if sq_64 == 0.0:
        # an all-zero (or all non-finite) output: absolute errors, on the scale of 1
        return sq_ref ** 0.5, sq_out ** 0.5
    return (sq_ref / sq_64) ** 0.5, (sq_out / sq_64) ** 0.5


def fp64_verdict(check: OutputCheck, numerics: Numerics) -> Optional[str]:
    """Why the candidate's output is less accurate than the reference's, or None."""
    ref_rel, cand_rel = check.ref_fp64_rel_rms, check.fp64_rel_rms
    if ref_rel is None or cand_rel is None or ref_rel > numerics.fp64_applies_below:
        return None
    allowed = numerics.rms_factor * ref_rel + numerics.rms_slack_eps * numerics.eps
    if cand_rel <= allowed:
        return None
    return (f"output {check.index}: relative RMS error {cand_rel:.3g} against the reference run in float64, "
            f"the {numerics.precision} reference's is {ref_rel:.3g} (allowed: {numerics.rms_factor:g}x that "
            f"+ {numerics.rms_slack_eps:g} {numerics.precision} epsilons = {allowed:.3g})")
