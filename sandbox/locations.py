"""Where a candidate's output differs from the reference: a compact map, stored with the check.

The comparison (``sandbox.compare``) knows every wrong element; storing them all is out of the
question for outputs of gigabytes. What the critic needs to name a pattern fits in a few hundred
numbers: per axis, how many wrong elements each index holds (run-length encoded), the period of
those counts when they repeat; the step between wrong elements in memory order; where the first
wrong and the first non-finite element sit; and how the wrong values relate to the right ones
(negated, scaled by one constant, transposed). ``sandbox.locate`` computes it; the critic's
``agent.critic.patterns`` names the pattern from it. No torch here, so the result model stays light.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

MAX_RUNS = 64          # runs kept per axis (``truncated`` says when more existed)


class AxisMap(BaseModel):
    axis: int
    size: int
    slice_numel: int                       # elements per index along this axis
    runs: list[list[int]] = []             # [start, end, wrong elements per index], equal neighbours merged
    truncated: bool = False                # more than MAX_RUNS runs: ``runs`` covers a prefix of the axis
    period: Optional[int] = None           # smallest k (size % k == 0): index i holds wrong elements iff i % k does
    period_counts: list[int] = []          # counts over one period


class ValueMap(BaseModel):
    """How the wrong values relate to the reference's, over the wrong elements finite on both sides."""
    wrong_finite: int = 0                  # wrong elements finite in both
    sign_flips: int = 0                    # of those, equal to minus the reference within the tolerance
    ratio_count: int = 0                   # of those, with |reference| large enough for a ratio
    ratio_min: Optional[float] = None      # candidate / reference over those
    ratio_max: Optional[float] = None
    transposed: Optional[str] = None       # "axes": out == ref with its last two axes swapped;
                                           # "layout": out is ref's transpose written in ref's shape


class MismatchMap(BaseModel):
    shape: list[int]
    wrong: int                             # wrong elements (the check's ``mismatched``)
    axes: list[AxisMap] = []
    flat_step: Optional[int] = None        # every wrong flat index is offset mod step ...
    flat_offset: Optional[int] = None
    flat_slots: Optional[int] = None       # ... and this many flat indices have that residue
    first_wrong: Optional[list[int]] = None
    first_nonfinite: Optional[list[int]] = None   # first NaN/Inf where the reference is finite (memory order)
    nonfinite: int = 0
    values: Optional[ValueMap] = None
