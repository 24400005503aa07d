"""A speedup's uncertainty: a bootstrap interval over the timed runs of both sides.

A speedup is a ratio of two medians, each from a handful of timed runs on a machine that may be
busy. ``speedup_interval`` resamples both sides' per-run times (``Timing.samples_ms``) with
replacement and takes the 2.5th and 97.5th percentiles of the resampled ratios of medians; the
random generator is seeded from the samples, so the same evidence always gives the same interval.
Timings stored before per-run times were kept fall back to a wider interval from the quartiles
(``method="iqr"``: each median moved by half its IQR against the ratio).

``label``: ``faster`` only when the whole interval is above 1, ``slower`` only when it is below 1,
otherwise ``inconclusive``. Nothing else may call a speed.
"""
from __future__ import annotations

import hashlib
import random
import statistics
from dataclasses import dataclass
from typing import Any, Optional

LEVEL = 0.95
RESAMPLES = 2000
BUSY_LOAD = 1.0            # load average per usable CPU above which the timed runs shared the CPUs


@dataclass(frozen=True)
class SpeedupInterval:
    point: float               # base median / candidate median (the stored speedup)
    low: float
    high: float
    method: str                # bootstrap | iqr
    base_runs: int
    cand_runs: int
    level: float = LEVEL

    @property
    def label(self) -> str:
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "inconclusive"

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point, "low": self.low, "high": self.high, "method": self.method,
                "level": self.level, "label": self.label}


def _seed(a: list[float], b: list[float]) -> int:
    return int.from_bytes(hashlib.sha256(repr((a, b)).encode()).digest()[:8], "big")


def _percentile(sorted_vals: list[float], q: float) -> float:
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def bootstrap_ratio(base: list[float], cand: list[float], level: float = LEVEL,
                    resamples: int = RESAMPLES) -> tuple[float, float]:
    rng = random.Random(_seed(base, cand))
    nb, nc = len(base), len(cand)
    ratios = []
    for _ in range(resamples):
        mb = statistics.median(rng.choices(base, k=nb))
        mc = statistics.median(rng.choices(cand, k=nc))
        ratios.append(mb / mc if mc > 0 else float("inf"))
    ratios.sort()
    tail = (1.0 - level) / 2.0
    return _percentile(ratios, tail), _percentile(ratios, 1.0 - tail)


def speedup_interval(base: Any, cand: Any) -> Optional[SpeedupInterval]:
    """The interval of ``base.median_ms / cand.median_ms`` (two ``Timing``s), or None without both."""
    if base is None or cand is None or not cand.median_ms or cand.median_ms <= 0:
        return None
    point = base.median_ms / cand.median_ms
    bs, cs = list(getattr(base, "samples_ms", None) or []), list(getattr(cand, "samples_ms", None) or [])
    if len(bs) >= 3 and len(cs) >= 3 and min(cs) > 0:
        low, high = bootstrap_ratio(bs, cs)
        return SpeedupInterval(point, min(low, point), max(high, point), "bootstrap", len(bs), len(cs))
    num_lo, num_hi = base.median_ms - base.iqr_ms / 2, base.median_ms + base.iqr_ms / 2
    den_lo, den_hi = cand.median_ms - cand.iqr_ms / 2, cand.median_ms + cand.iqr_ms / 2
    low = max(num_lo, 0.0) / den_hi if den_hi > 0 else 0.0
    high = num_hi / den_lo if den_lo > 0 else float("inf")
    return SpeedupInterval(point, min(low, point), max(high, point), "iqr", base.runs, cand.runs)


def busy(*timings: Any) -> Optional[float]:
    """The highest host load per CPU recorded with these timings when it exceeds ``BUSY_LOAD``."""
    loads = [t.host_load for t in timings if t is not None and getattr(t, "host_load", None) is not None]
    worst = max(loads) if loads else None
    return worst if worst is not None and worst > BUSY_LOAD else None


def relative_spread(t: Any) -> Optional[float]:
    """IQR over median of one timing."""
    return t.iqr_ms / t.median_ms if t is not None and t.median_ms > 0 else None
