"""Across rounds, the profile decides which generated group keeps its kernel.

A correct attempt that ran slower than eager PyTorch (``speedup_eager < 1``) lost time in one of
its own kernels. The sandbox's profile of that attempt (``EvalResult.profile``: device time per
kernel, ``own`` for the candidate's) names them: ``kl_g3_kernel``/``kl_g3_kernel4`` on cuda,
``kl_g3`` on the CPU. The group whose kernels took the most time is left to PyTorch in later
rounds (the library's call comes back for that part), unless the same group (same nodes) ran in
an attempt at least as fast as eager, or it is the attempt's last kernel (then the search goes on
over its variants instead). One group per slow attempt, so a round narrows step by step
and the best attempt of the run (the fastest correct) decides in the end.
"""
from __future__ import annotations

import re
from typing import Any, Optional

# a group's kernels are ``kl_gN`` and ``kl_gN_<what>`` (``_kernel4``, a two-pass norm's ``_part`` and
# ``_fin``, ``_regs``, ``_cols``, ...: the templates' names); session x's 47_NetVlad counted only its
# ``_kernel4`` group, so the slowest one (a norm's ``_part`` + ``_fin``, 0.21 of 1.41 ms) was never blamed
_OWN_GROUP = re.compile(r"\bkl_g(\d+)(?:_[A-Za-z]\w*)?\b")


def group_times(result: Any) -> dict[str, float]:
    """Microseconds per generated group (``kl_gN``) in an attempt's profile."""
    out: dict[str, float] = {}
    for stat in getattr(result, "profile", None) or []:
        m = _OWN_GROUP.search(str(getattr(stat, "name", "")))
        if m is None:
            continue
        name = f"kl_g{m.group(1)}"
        out[name] = out.get(name, 0.0) + float(getattr(stat, "total_us", 0.0) or 0.0)
    return out


def slowest_group(result: Any, header: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The header's group whose kernels took the most profiled time, or None (no profile)."""
    times = group_times(result)
    groups = [g for g in header.get("groups", []) if g.get("name") in times]
    return max(groups, key=lambda g: times[g["name"]]) if groups else None


def blame_slow(correct: list[tuple[Any, dict[str, Any]]], fb: Any) -> None:
    """Leave to PyTorch (``fb.excluded``) the slowest group of every correct attempt slower than
    eager, unless that group ran in an attempt at least as fast as eager."""
    fast = {tuple(g["nodes"]) for att, h in correct
            if (getattr(att.result, "speedup_eager", None) or 0.0) >= 1.0 for g in h.get("groups", [])}
    for att, h in correct:
        s = getattr(att.result, "speedup_eager", None)
        if s is None or s >= 1.0:
            continue
        g = slowest_group(att.result, h)
        if g is None or tuple(g["nodes"]) in fast:
            continue
        left = [x for x in h.get("groups", []) if not set(x["nodes"]) <= (fb.excluded | set(g["nodes"]))]
        if not left:
            # its last kernel: leaving it to PyTorch too would leave no kernel to search over (every
            # variant the same fallback); the knobs' other variants are measured instead
            continue
        fb.excluded |= set(g["nodes"])
        ms = group_times(att.result)[g["name"]] / 1000.0
        fb.notes.append(f"attempt {att.attempt_id} (correct, {s:.2f}x eager): its slowest kernel is {g['name']} "
                        f"({' -> '.join(g.get('ops', []))}, {ms:.3g} ms in the profile): left to PyTorch")
