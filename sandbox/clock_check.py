"""The parent's own clock against the times a worker reports for its timed runs.

A candidate that slows the clock its worker reads (``time.perf_counter`` patched, a C-level timer
hooked) reports timed runs shorter than they were; the parent, outside the worker, sees the whole
ask take far longer than the runs it was told of. What the reference's own ask took beyond its
reported runs (warm-ups, messages) is allowed the candidate too; more than ``CLOCK_SLACK_S`` and
``CLOCK_FACTOR`` times the reported total besides is ``suspicious``.

A loaded host does the same to an honest worker: descheduled for most of an ask, its runs are
reported as they ran while the parent's clock kept going (CI's two cores with a llama.cpp server
and a second pytest beside the suite: an honest Triton candidate's 5 runs reported as 50 ms took
901 ms of the parent's clock). On ``cpu`` the worker's own CPU time tells the two apart: a worker
that computed for the unexplained time used that CPU (its threads and children count); one that
waited for a core did not. There the gap without the CPU time to match is the host's: the timing is
``contended`` (no clean speedup), the candidate not ``suspicious``. On ``cuda`` the device does the
work, and a worker's CPU time says nothing of it: the wall-clock rule alone, except where the
worker's caching allocator retried failed allocations during the timed runs (``Timing.alloc_retries``):
the GPU's memory was short, which costs host time no event sees, and the timing is ``contended``. (A
worker that reports retries it did not make only trades ``suspicious`` for ``contended``: neither is
clean.)
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

from sandbox.containment import tree_cpu_seconds
from sandbox.result import EvalResult, FlagKind

CLOCK_SLACK_S = 0.25
CLOCK_FACTOR = 3.0


class Spent:
    """The parent's wall-clock seconds over the asks made inside ``during()``, and the CPU seconds
    the worker ``pid`` (and the processes below it) used over them."""

    def __init__(self, pid: Optional[int]):
        self.pid = pid
        self.wall = 0.0
        self.cpu: Optional[float] = 0.0 if pid else None

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        w0 = time.monotonic()
        c0 = tree_cpu_seconds(self.pid) if self.pid else 0.0
        try:
            yield
        finally:
            self.wall += time.monotonic() - w0
            if self.cpu is not None and self.pid:
                self.cpu += max(0.0, tree_cpu_seconds(self.pid) - c0)


def _unexplained(seen_s: float, reported_s: float, ref_seen_s: float, ref_reported_s: float) -> float:
    return seen_s - reported_s - max(0.0, ref_seen_s - ref_reported_s)


def _over(unexplained: float, reported_s: float) -> bool:
    return unexplained > CLOCK_SLACK_S and unexplained > CLOCK_FACTOR * max(reported_s, 1e-3)


def clock_check(result: EvalResult, ref: Spent, cand: Spent, device: str) -> None:
    """Flags ``result`` when the parent's clock leaves the candidate's reported runs unexplained
    (the module's rule)."""
    assert result.candidate_time is not None and result.eager_time is not None
    runs = result.candidate_time.runs
    reported = result.candidate_time.mean_ms * runs / 1e3
    ref_reported = result.eager_time.mean_ms * runs / 1e3
    if not _over(_unexplained(cand.wall, reported, ref.wall, ref_reported), reported):
        return
    seen = (f"the parent's clock saw {cand.wall * 1e3:.1f} ms for {runs} timed runs the worker reported as "
            f"{reported * 1e3:.1f} ms in total")
    retries = result.candidate_time.alloc_retries or 0
    if device == "cuda" and retries > 0:
        result.add_flag(FlagKind.contended, f"{seen}, and its allocator retried {retries} time(s) after failed "
                        "allocations in that time: the GPU's memory was short (the harness's condition), so "
                        "the timing is not the candidate's")
        return
    if device == "cpu" and cand.cpu is not None and ref.cpu is not None:
        if not _over(_unexplained(cand.cpu, reported, ref.cpu, ref_reported), reported):
            result.add_flag(FlagKind.contended, f"{seen}, but its worker used only {cand.cpu * 1e3:.1f} ms of CPU "
                            "in that time: it waited for a core (a loaded host), so the timing is not the candidate's")
            return
        seen += f", and its worker used {cand.cpu * 1e3:.1f} ms of CPU in that time"
    result.add_flag(FlagKind.suspicious, seen)
