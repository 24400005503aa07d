"""The built-in's search: each round's variants are chosen from what earlier rounds measured.

Every generated candidate names its parent in its header (``parent``: the attempt id of the
fastest correct attempt it was derived from, ``changed``: the knobs it sets differently, as
``{knob: [parent's, its own]}``). From the evaluations stored for those attempts:

* ``steps``: each measured child against its parent: the knobs changed and the time ratio
  (child median / parent median, both from their own evaluations);
* ``lost``: a knob value whose every measured step was slower than its parent by more than
  ``LOSS`` is tried again only after every other neighbour of the incumbent (a change that
  won, or was never measured, comes first);
* ``STRUCTURAL`` changes (the GEMM's mode, the convolutions' layout and algorithm) not yet
  measured come before every other change, whatever the profile: over session s's 100 level-2
  tasks (300 measured steps) a layout change was more than 10% faster than its parent in 25 of
  49 steps and a convolution change in 5 of 9, a block size change in 1 of 141 and a vector
  width change in 1 of 31; a profile that put the kernels' own knobs first (the rule before)
  spent rounds 1-3 of level2/91 (a softmax over channels, 50% of its time in its own kernel) on
  block sizes and never tried channels-last;
* ``doubtful``: a knob value the measured evidence says will likely fail, tried only after every
  other neighbour like a loss: channels-last where the reference's convolutions ran cuDNN's full
  fp32 kernels while the candidate's would run in TF32 (``feedback.fp32_reference_convolution``;
  session af, one H100, level 2: of 20 convolution tasks whose reference profile named only full
  fp32 convolution kernels, 17 had their channels-last candidate judged incorrect or inaccurate,
  the other three rendering no different convolution; of 43 with TF32 ones, none);
* ``own_share``: the share of the incumbent's profiled time spent in its own kernels, which
  orders the rest. Where it is small (below ``LIBRARY_BOUND``) the library operators dominate,
  and knobs that only retune the generated kernels (block, vec, reduce) can gain little: the
  changes that move work between the library and the kernels (fusion cuts) are tried first;
  where it is large (``KERNEL_BOUND``) the kernels' own knobs come first.

The incumbent is never lost: the loop's best is the clean attempt of all rounds with the highest
speedup vs eager (``loop.best_clean``), so each round's best-so-far is at least the previous round's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

LOSS = 1.02                 # a step 2% slower than its parent counts as a loss
LIBRARY_BOUND = 0.15        # own kernels below this share of the profile: library-bound
KERNEL_BOUND = 0.5          # own kernels at or above it: the kernels' own knobs first
KERNEL_ONLY = ("block", "vec", "reduce", "conv_tile")
STRUCTURAL = ("matmul", "layout", "conv", "graph")


@dataclass
class Step:
    attempt: int
    parent: int
    changed: dict[str, list[Any]]       # knob -> [parent's value, child's value]
    ms: float
    parent_ms: float

    @property
    def ratio(self) -> float:
        return self.ms / self.parent_ms


@dataclass
class SearchState:
    steps: list[Step] = field(default_factory=list)
    lost: set[tuple[str, Any]] = field(default_factory=set)
    won: set[tuple[str, Any]] = field(default_factory=set)
    doubtful: set[tuple[str, Any]] = field(default_factory=set)
    own_share: Optional[float] = None


def _median_ms(result: Any) -> Optional[float]:
    t = getattr(result, "candidate_time", None)
    return t.median_ms if t is not None else None


def own_share(result: Any) -> Optional[float]:
    """The share of the profiled time spent in the candidate's own kernels (None: no profile)."""
    profile = getattr(result, "profile", None) or []
    if not profile:
        return None
    return sum(k.share for k in profile if k.own)


def read_search(measured: list[tuple[Any, dict[str, Any]]], best_attempt: Optional[int]) -> SearchState:
    """``measured``: (AttemptView, header) of the correct, undoubted attempts generated for this
    run's convention (``feedback.read_history`` picks them)."""
    state = SearchState()
    ms_of = {a.attempt_id: _median_ms(a.result) for a, _ in measured}
    for att, h in measured:
        parent, changed = h.get("parent"), h.get("changed") or {}
        ms, parent_ms = ms_of.get(att.attempt_id), ms_of.get(parent)
        if parent is None or not changed or not ms or not parent_ms:
            continue
        state.steps.append(Step(att.attempt_id, parent, dict(changed), ms, parent_ms))
    outcomes: dict[tuple[str, Any], list[float]] = {}
    for s in state.steps:
        for knob, (_, new) in s.changed.items():
            if knob == "excluded":          # nodes left to PyTorch, not a knob value to rank
                continue
            outcomes.setdefault((knob, new), []).append(s.ratio)
    for kv, ratios in outcomes.items():
        if all(r > LOSS for r in ratios):
            state.lost.add(kv)
        elif any(r < 1.0 for r in ratios):
            state.won.add(kv)
    best = next((a for a, _ in measured if a.attempt_id == best_attempt), None)
    if best is not None:
        state.own_share = own_share(best.result)
    return state


def neighbour_key(diff: dict[str, Any], state: Optional[SearchState]) -> tuple[int, tuple[int, int, int]]:
    """(measured losses and doubts, rank) for a variant that sets the knobs ``diff`` (knob -> value)
    differently from the incumbent: the losses and doubts sort before the distance, the rank (measured wins
    first, then structural changes, then the profile's order) after it, before the fixed knob
    priority."""
    structural = 0 if diff and all(k in STRUCTURAL for k in diff) else 1
    if state is None:
        return 0, (0, structural, 0)
    lost = sum(1 for kv in diff.items() if kv in state.lost or kv in state.doubtful)
    won = sum(1 for kv in diff.items() if kv in state.won)
    kernel_only = bool(diff) and all(k in KERNEL_ONLY for k in diff)
    share = state.own_share
    profile = 0
    if kernel_only and share is not None:
        profile = 1 if share < LIBRARY_BOUND else -1 if share >= KERNEL_BOUND else 0
    return lost, (-won, structural, profile)


def lineage(header: dict[str, Any], best_attempt: Optional[int], best_knobs: dict[str, Any],
            best_excluded: Optional[list[str]] = None) -> dict[str, Any]:
    """The header entries naming a candidate's parent and what it changed: the knobs it sets
    differently and, as ``excluded``, the nodes it leaves to PyTorch where those differ (a group
    the profile showed slower than the library goes back to it with the same knobs)."""
    if best_attempt is None:
        return {}
    mine = header.get("knobs") or {}
    changed = {k: [best_knobs.get(k), v] for k, v in mine.items() if best_knobs.get(k) != v}
    if best_excluded is not None and sorted(best_excluded) != sorted(header.get("excluded") or []):
        changed["excluded"] = [sorted(best_excluded), sorted(header.get("excluded") or [])]
    return {"parent": best_attempt, "changed": changed}
