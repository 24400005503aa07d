"""Where each round's gain came from: one line per round of one task.

The best of a task is the loop's (``loop.best_clean``: the clean attempt with the highest
speedup over eager, timed in its own evaluation, of every round so far), so it never gets
worse from one round to the next. For a round that raised it, the line names the new best
attempt, its parent and what changed: the knobs it set differently (a built-in candidate's
header records them, see ``agent/builtin/search.py``), or a model's rewrite of the parent; and
the measured delta (each attempt's median in its own evaluation).
"""
from __future__ import annotations

from typing import Any, Optional

from agent.types import AttemptView


def _ms(v: AttemptView) -> Optional[float]:
    t = v.result.candidate_time if v.result is not None else None
    return t.median_ms if t is not None else None


def _clean(v: AttemptView) -> bool:
    return v.result is not None and v.result.clean and bool(v.result.speedup_eager) and _ms(v) is not None


def _origin(v: AttemptView, by_id: dict[int, AttemptView]) -> str:
    from agent.builtin.feedback import parse_header

    h = parse_header(v.source) or {}
    if h.get("generator") == "builtin":
        parent = by_id.get(h.get("parent")) if h.get("parent") is not None else None
        if parent is None:
            knobs = ", ".join(f"{k}={val}" for k, val in sorted((h.get("knobs") or {}).items()))
            return f"the built-in's first variant ({knobs or 'no knobs'})"
        changed = h.get("changed") or {}
        what = ", ".join(_change(k, a, b) for k, (a, b) in sorted(changed.items())) or "the same knobs"
        return f"{what} vs parent attempt {parent.attempt_id}{_delta(v, parent)}"
    parent = next((by_id[p] for p in v.parent_ids if p in by_id), None)
    if parent is None:
        return "a new candidate (no parent)"
    return f"the model's rewrite of attempt {parent.attempt_id}{_delta(v, parent)}"


def _change(knob: str, old: Any, new: Any) -> str:
    if knob == "excluded":
        back, kept = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        return "; ".join(filter(None, [f"{', '.join(back)} left to PyTorch" if back else "",
                                       f"{', '.join(kept)} fused again" if kept else ""])) or "the same groups"
    return f"{knob} {old}->{new}"


def _delta(v: AttemptView, parent: AttemptView) -> str:
    a, b = _ms(parent), _ms(v)
    if not a or not b:
        return ""
    return f" ({a:.4g} -> {b:.4g} ms, {100.0 * (b - a) / a:+.1f}%)"


def round_gains(views: list[AttemptView]) -> list[str]:
    """One line per round: the best so far after it, and where its gain came from."""
    by_id = {v.attempt_id: v for v in views}
    lines: list[str] = []
    best: Optional[AttemptView] = None
    for rnd in sorted({v.round for v in views}):
        clean = [v for v in views if v.round == rnd and _clean(v)]
        top = max(clean, key=lambda v: v.result.speedup_eager) if clean else None
        if top is not None and (best is None or top.result.speedup_eager > best.result.speedup_eager):
            before = (f"{best.result.speedup_eager:.3f}x -> " if best is not None else "")
            lines.append(f"round {rnd}: best {before}{top.result.speedup_eager:.3f}x vs eager "
                         f"(attempt {top.attempt_id}, {_ms(top):.4g} ms): {_origin(top, by_id)}")
            best = top
        elif best is not None:
            tried = f"; this round's fastest, attempt {top.attempt_id}: {_origin(top, by_id)}" if top else ""
            lines.append(f"round {rnd}: no gain; best stays {best.result.speedup_eager:.3f}x vs eager "
                         f"(attempt {best.attempt_id}){tried}")
        else:
            lines.append(f"round {rnd}: no clean attempt yet")
    return lines
