"""Error patterns: where an incorrect output is wrong, named with the indices and sizes that prove it.

Input: the ``MismatchMap`` the comparison stored with an output's check (``sandbox.locations``).
Output: ``Pattern``s, each a kind, one sentence quoting stored indices and counts, what such a
pattern usually means in a kernel, and the numbers it quotes. Both critics read them.

Kinds: ``tail`` / ``head`` (a contiguous range at the end or start of an axis), ``block_multiple``
(the same part of every block of k along an axis), ``every_kth`` (one index in every k along an
axis, or in memory order), ``boundary`` (the first and last indices of a spatial axis), ``group``
(one contiguous range inside an axis: a channel or a group of them), ``sign``, ``scale``, ``zero``
(the wrong elements are the reference's negated, scaled by one constant, or zero),
``transposed``, ``nonfinite`` (where NaN or Inf first appears), ``everywhere``, ``scattered``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.critic.fmt import sig
from sandbox.locations import AxisMap, MismatchMap

AXIS_NAMES = {1: ["elements"], 2: ["rows", "columns"], 3: ["samples", "channels", "positions"],
              4: ["samples", "channels", "rows", "columns"],
              5: ["samples", "channels", "depth slices", "rows", "columns"]}
SPATIAL_FROM = {3: 2, 4: 2, 5: 2}        # first spatial axis by rank (N, C, spatial...)

MEANING = {
    "tail": "a grid or loop bound that stops short (a block count from floor division, `n / block` "
            "instead of `(n + block - 1) / block`) leaves the tail unwritten",
    "head": "the start index or offset is wrong, so the first indices are skipped or overwritten",
    "block_multiple": "each block or tile stops short of its end (a tile loop bound, or a per-tile remainder "
                      "that is dropped)",
    "every_kth": "a stride or vector width mismatch: the indexing steps by k but handles only one of the k, "
                 "or a vectorised loop's remainder lane is wrong",
    "boundary": "the edges of the spatial dimensions are handled wrongly (padding, halo or border conditions)",
    "group": "one channel or group gets the wrong parameters or statistics (an index into per-channel or "
             "per-group data that is off for that group)",
    "sign": "a negation: a subtraction in the wrong order or a sign in the formula",
    "scale": "a constant factor: a scale applied twice, missing, or the wrong constant",
    "zero": "those elements were never written (the buffer was zero-initialised)",
    "transposed": "row and column indices are swapped (the kernel writes `out[j][i]` for `out[i][j]`)",
    "nonfinite": "NaN or Inf arise in the computation (overflow, division by zero, the square root or "
                 "logarithm of a negative number, or uninitialised memory)",
    "everywhere": "the computation itself is wrong (the formula, the statistics or the indexing), not the "
                  "handling of boundaries",
    "scattered": "a race, uninitialised memory or reduced precision (isolated wrong elements with no structure)",
}


@dataclass
class Pattern:
    kind: str
    sentence: str                       # quotes stored indices and counts only
    numbers: dict[str, Any] = field(default_factory=dict)
    axis: Optional[int] = None

    @property
    def meaning(self) -> str:
        return MEANING[self.kind]


def axis_name(axis: int, ndim: int) -> str:
    names = AXIS_NAMES.get(ndim)
    return names[axis] if names else f"indices along dimension {axis}"


SINGULAR = {"elements": "element", "rows": "row", "columns": "column", "samples": "sample", "channels": "channel",
            "positions": "position", "depth slices": "depth slice"}


def ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _named(name: str, a: int, b: int) -> str:
    """``rows 96-127`` or ``row 5``."""
    return f"{SINGULAR.get(name, name)} {a}" if b - a == 1 else f"{name} {a}-{b - 1}"


def _span(a: int, b: int) -> str:
    """Indices a..b-1 written inclusively."""
    return f"{a}" if b - a == 1 else f"{a}-{b - 1}"


def _bad_ranges(ax: AxisMap) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e, c in ax.runs:
        if c > 0:
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
    return out


def _block_note(start: int, length: int) -> str:
    g = math.gcd(start, length)
    if g < 8 or g & (g - 1):
        return ""
    return f" (one block of {g})" if g == length else f" ({length // g} blocks of {g})"


def _axis_patterns(ax: AxisMap, ndim: int, wrong: int) -> list[Pattern]:
    if ax.truncated or ax.size < 2:
        return []
    name = axis_name(ax.axis, ndim)
    n = ax.size
    ranges = _bad_ranges(ax)
    held = sum((e - s) * c for s, e, c in ax.runs)
    nums = {"axis": ax.axis, "size": n, "wrong": held}
    if not ranges or (len(ranges) == 1 and ranges[0] == (0, n)):
        return []                                      # every index holds wrong elements: no pattern here
    if len(ranges) == 1:
        s, e = ranges[0]
        length = e - s
        exact = _named(name, 0, s) if s else _named(name, e, n)
        are = "is" if length == 1 else "are"
        exact_are = "is" if (s == 1 or (not s and n - e == 1)) else "are"
        last = "the last" if length == 1 else f"the last {length}"
        if e == n:
            g = math.gcd(s, length)
            return [Pattern("tail", f"{_named(name, s, e)}, {last} of {n}{_block_note(s, length)}, {are} wrong "
                                    f"(holding all {held} wrong elements); {exact} {exact_are} exact",
                            {**nums, "start": s, "end": e - 1, "length": length, "exact_first": 0,
                             "exact_last": s - 1, "block": g, "blocks": length // g if g else 0}, ax.axis)]
        if s == 0:
            first = "the first" if length == 1 else f"the first {length}"
            return [Pattern("head", f"{_named(name, s, e)}, {first} of {n}, {are} wrong (holding all "
                                    f"{held} wrong elements); {exact} {exact_are} exact",
                            {**nums, "start": s, "end": e - 1, "length": length, "exact_first": e,
                             "exact_last": n - 1}, ax.axis)]
        group = ""
        if n % length == 0 and s % length == 0 and length > 1:
            group = f", group {s // length} of {n // length} groups of {length}"
        one = "one of" if length == 1 else f"{length} of"
        return [Pattern("group", f"only {_named(name, s, e)} ({one} {n}{group}) {'is' if length == 1 else 'are'} wrong "
                                 f"(holding all {held} wrong elements); the other {name} are exact",
                        {**nums, "start": s, "end": e - 1, "length": length, "group": s // length,
                         "groups": n // length}, ax.axis)]
    spatial = SPATIAL_FROM.get(ndim, 0 if ndim <= 2 else ndim)
    if len(ranges) == 2 and ranges[0][0] == 0 and ranges[1][1] == n and ax.axis >= spatial and ndim >= 2:
        w0, w1 = ranges[0][1], n - ranges[1][0]
        if w0 == w1 and w0 <= max(1, n // 8):
            edge = (f"{name} 0 and {n - 1}" if w0 == 1 else f"{name} {_span(0, w0)} and {_span(n - w0, n)}")
            return [Pattern("boundary", f"the boundary {edge} (of {n} along dimension {ax.axis}) are wrong "
                                        f"(holding all {held} wrong elements); {name} {_span(w0, n - w0)} are exact",
                            {**nums, "first": 0, "width": w0, "last": n - 1, "inner_start": w0,
                             "inner_end": n - w0 - 1, "outer_start": n - w0},
                            ax.axis)]
    if ax.period:
        k = ax.period
        hot = [i for i, c in enumerate(ax.period_counts) if c > 0]
        blocks = n // k
        if len(hot) == 1:
            r = hot[0]
            one = SINGULAR.get(name, name)
            return [Pattern("every_kth", f"every {ordinal(k)} {one} is wrong ({name} {r}, {r + k}, "
                                         f"{r + 2 * k}, ...: {blocks} of {n}, each at offset {r} of its group of {k}); "
                                         f"the other {name} are exact",
                            {**nums, "period": k, "offset": r, "count": blocks, "second": r + k,
                             "third": r + 2 * k}, ax.axis)]
        if hot == list(range(hot[0], hot[-1] + 1)):
            a, b = hot[0], hot[-1] + 1
            return [Pattern("block_multiple", f"{name} {_span(a, b)} of every block of {k} ({blocks} blocks of "
                                              f"{n}) are wrong, the same {b - a} in each block; the other {name} "
                                              f"are exact",
                            {**nums, "period": k, "start": a, "end": b - 1, "length": b - a, "blocks": blocks},
                            ax.axis)]
    return []


def _value_patterns(m: MismatchMap) -> list[Pattern]:
    v = m.values
    if v is None or not v.wrong_finite:
        return []
    out = []
    if v.transposed:
        how = ("it equals the reference with its last two axes swapped" if v.transposed == "axes" else
               f"it holds the reference's transpose ({m.shape[-1]} x {m.shape[-2]}) written in the reference's "
               f"shape")
        out.append(Pattern("transposed", f"a transposition: {how}",
                           {"rows": m.shape[-2], "cols": m.shape[-1]}))
        return out
    if v.sign_flips == v.wrong_finite:
        out.append(Pattern("sign", f"sign only: each of the {v.wrong_finite} wrong elements is the reference's "
                                   f"value negated", {"wrong": v.wrong_finite}))
        return out
    if v.ratio_count and v.ratio_count >= 0.95 * v.wrong_finite and v.ratio_min is not None:
        lo, hi = v.ratio_min, v.ratio_max
        if abs(hi - lo) <= 1e-3 * max(abs(lo), abs(hi), 1e-12) or (lo == 0 and hi == 0):
            if lo == 0:
                out.append(Pattern("zero", f"the {v.ratio_count} wrong elements checked are all zero",
                                   {"count": v.ratio_count}))
            else:
                out.append(Pattern("scale", f"a constant scale factor: each of the {v.ratio_count} wrong elements "
                                            f"checked is {sig(lo, 4)} times the reference's value (ratio {sig(lo, 4)} "
                                            f"to {sig(hi, 4)})",
                                   {"factor": lo, "factor_max": hi, "count": v.ratio_count}))
    return out


def classify(m: Optional[MismatchMap], numel: int) -> list[Pattern]:
    """The patterns an output's map proves, most specific first (empty without a map)."""
    if m is None or not m.wrong:
        return []
    out: list[Pattern] = []
    ndim = len(m.shape)
    if m.nonfinite and m.first_nonfinite is not None:
        where = ", ".join(str(i) for i in m.first_nonfinite)
        out.append(Pattern("nonfinite", f"NaN or Inf first appears at index [{where}] in memory order "
                                        f"({m.nonfinite} non-finite of {numel} elements)",
                           {"index": list(m.first_nonfinite), "nonfinite": m.nonfinite, "numel": numel}))
    for ax in m.axes:
        out += _axis_patterns(ax, ndim, m.wrong)
    located = any(p.axis is not None for p in out)
    if not located and m.flat_step and m.flat_slots and m.wrong >= 0.9 * m.flat_slots and m.flat_step <= 4096:
        k = m.flat_step
        out.append(Pattern("every_kth", f"every {ordinal(k)} element in memory order is wrong (flat indices "
                                        f"{m.flat_offset} mod {k}: {m.wrong} of the {m.flat_slots} such elements); "
                                        f"the others are exact",
                           {"period": k, "offset": m.flat_offset, "count": m.wrong, "slots": m.flat_slots}))
    located = any(p.kind not in ("nonfinite",) for p in out)
    if not located and numel and m.wrong >= 0.9 * numel:
        out.append(Pattern("everywhere", f"wrong everywhere: {m.wrong} of {numel} elements",
                           {"wrong": m.wrong, "numel": numel}))
        located = True
    values = _value_patterns(m)
    out += values
    if not located and not values:
        if not m.nonfinite:
            out.append(Pattern("scattered", f"{m.wrong} wrong elements of {numel} with no row, column, block or "
                                            f"stride structure (first at index "
                                            f"[{', '.join(str(i) for i in m.first_wrong or [])}])",
                               {"wrong": m.wrong, "numel": numel, "first": list(m.first_wrong or [])}))
    return out


def pattern_numbers(patterns: list[Pattern]) -> list[float]:
    """Every number the patterns' sentences quote (for the evidence the number checks read)."""
    vals: list[float] = []
    for p in patterns:
        for v in p.numbers.values():
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    vals.append(float(x))
        if p.axis is not None:
            vals.append(float(p.axis))
    return vals
