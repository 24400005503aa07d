"""Speed claims within their uncertainty.

Every speedup the critics state carries its interval (``sandbox.intervals``): a candidate is
called faster or slower than a baseline only when the whole interval, as printed, lies on one
side of 1x; otherwise the claim is ``inconclusive`` and says why (the runs' spread, a busy host,
or two times too close to tell apart). ``contradictions`` finds any sentence of an analysis
whose speed label disagrees with the interval it prints (the test corpus must have none).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.critic.numbers import fmt_ms, fmt_pct, fmt_x, sig
from sandbox.intervals import SpeedupInterval, busy, relative_spread, speedup_interval

BASELINES = {"eager": ("eager_time", "eager PyTorch"), "compile": ("compile_time", "torch.compile")}
NOISY = 0.25             # IQR above a quarter of the median: the runs spread widely


@dataclass
class SpeedClaim:
    baseline: str                       # eager | compile
    label: str                          # faster | slower | inconclusive
    interval: SpeedupInterval
    sentence: str                       # "Faster than eager PyTorch: 2.01x (95% interval 1.93x-2.08x, ...)"
    reasons: list[str] = field(default_factory=list)    # why inconclusive
    numbers: dict[str, Any] = field(default_factory=dict)


def printed_label(iv: SpeedupInterval) -> str:
    """The label the printed interval supports: its printed bounds, not only its exact ones, exclude 1x."""
    one = fmt_x(1.0)
    if iv.label == "faster" and fmt_x(iv.low) != one:
        return "faster"
    if iv.label == "slower" and fmt_x(iv.high) != one:
        return "slower"
    return "inconclusive"


def interval_text(iv: SpeedupInterval) -> str:
    how = (f"over {iv.base_runs} and {iv.cand_runs} timed runs" if iv.method == "bootstrap"
           else "from the quartiles; no per-run times were stored")
    return f"{int(iv.level * 100)}% interval {fmt_x(iv.low)}-{fmt_x(iv.high)}, {how}"


def speed_claim(r: Any, baseline: str = "eager") -> Optional[SpeedClaim]:
    field_name, words = BASELINES[baseline]
    base, cand = getattr(r, field_name, None), r.candidate_time
    iv = speedup_interval(base, cand)
    if iv is None:
        return None
    label = printed_label(iv)
    numbers: dict[str, Any] = {"speedup": iv.point, "low": iv.low, "high": iv.high, "level": iv.level}
    contended = [f.reason for f in getattr(r, "flags", []) if getattr(f.kind, "value", f.kind) == "contended"]
    if contended:
        # the sandbox saw the device busy while timing (sandbox.quiet): no speed claim either way
        why = f"the device was not quiet while timing ({contended[0][:200]})"
        sentence = (f"Inconclusive against {words}: {why}, so the measured {fmt_x(iv.point)} is no evidence "
                    f"of its speed")
        return SpeedClaim(baseline, "inconclusive", iv, sentence, [why], numbers)
    if label == "faster":
        sentence = f"Faster than {words}: {fmt_x(iv.point)} ({interval_text(iv)})"
        return SpeedClaim(baseline, label, iv, sentence, numbers=numbers)
    if label == "slower":
        sentence = f"Slower than {words}: {fmt_x(iv.point)} ({interval_text(iv)})"
        return SpeedClaim(baseline, label, iv, sentence, numbers=numbers)
    reasons = []
    for who, t in (("the candidate's", cand), (f"{words}'s", base)):
        rel = relative_spread(t)
        if rel is not None and rel > NOISY:
            reasons.append(f"{who} runs spread widely (IQR {fmt_ms(t.iqr_ms)} around a median of "
                           f"{fmt_ms(t.median_ms)}, {fmt_pct(rel)} of it)")
            numbers[f"{'cand' if t is cand else 'base'}_iqr_ms"] = t.iqr_ms
    load = busy(base, cand)
    if load is not None:
        reasons.append(f"the host was busy while timing (load {sig(load, 3)} per CPU)")
        numbers["host_load"] = load
    if not reasons:
        reasons.append("the two medians are too close for these runs to tell apart")
    sentence = (f"Inconclusive against {words}: the point estimate is {fmt_x(iv.point)} but its "
                f"{interval_text(iv)}, includes 1x, because " + " and ".join(reasons))
    return SpeedClaim(baseline, "inconclusive", iv, sentence, reasons, numbers)


def speed_cell(r: Any, baseline: str = "eager") -> str:
    """A table cell: the point estimate and its interval, e.g. ``2.01x [1.93-2.08]``."""
    claim = speed_claim(r, baseline)
    if claim is None:
        point = r.speedup_eager if baseline == "eager" else r.speedup_compile
        return fmt_x(point) if point is not None else "—"
    iv = claim.interval
    return f"{fmt_x(iv.point)} [{fmt_x(iv.low)}-{fmt_x(iv.high)}]"


# a label, then within the same sentence (no ". " between) the interval it quotes
_CLAIM = re.compile(r"\b(?P<label>Faster than|Slower than|Inconclusive against|faster than|slower than)\b"
                    r"(?:(?!\.\s)[^\n]){0,240}?"
                    r"interval (?P<low>\d+(?:\.\d+)?)x-(?P<high>\d+(?:\.\d+)?)x")


def contradictions(markdown: str) -> list[str]:
    """Sentences whose speed label contradicts the interval they print."""
    bad = []
    for m in _CLAIM.finditer(markdown):
        label, low, high = m.group("label").lower(), float(m.group("low")), float(m.group("high"))
        if label.startswith("faster") and not low > 1.0:
            bad.append(m.group(0))
        elif label.startswith("slower") and not high < 1.0:
            bad.append(m.group(0))
        elif label.startswith("inconclusive") and (low > 1.0 or high < 1.0):
            bad.append(m.group(0))
    return bad
