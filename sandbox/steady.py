"""Steady timing windows (``sandbox.quiet``'s rules) for ``sandbox.checks.CandidateChecks``.

A window whose median is far above its own fastest run (``quiet.unsteady``) was shared with other
work for part of it; a reference median far above the task's fastest or off its running median
(``quiet.TimingHistory``) too. Such a timing is taken again with ``quiet`` held (the sandbox's
builds stopped) and the second window kept; still so: ``contended`` (the harness's condition,
never a clean speedup).

The candidate's window is held to the same rule as the reference's (``_candidate_window``): on
session af's H100 run 8 of 290 candidate windows were unsteady and judged clean, among them
level2/67's best (runs at 3.40 ms, ten of twenty at 5.7-9.9 ms: median 4.87 ms) and 74's
(0.64 ms fastest, median 4.30): a speedup read off such a median is the disturbance's.
"""
from __future__ import annotations

from typing import Any, Optional

from sandbox.clock_check import Spent
from sandbox.quiet import unsteady
from sandbox.reference import ReferenceWorker
from sandbox.result import EvalResult, FlagKind, Timing


def _unsteady_twice(result: EvalResult, what: str, why: str, again: Timing) -> None:
    """``contended`` where the second window of ``what`` (the first unsteady: ``why``) is unsteady too."""
    still = unsteady(again)
    if still is not None:
        result.add_flag(FlagKind.contended, f"{what} was not one steady window twice: {why}; timed again: {still}")


class SteadyWindows:
    """Mixed into ``CandidateChecks``: uses its ``config``, ``device``, ``history``, ``quiet`` and
    ``_spent``."""

    def _candidate_window(self, cand: Any, ask: dict[str, Any], reply: dict[str, Any], spent: Spent,
                          result: EvalResult) -> tuple[dict[str, Any], Spent]:
        """The candidate's timed ``reply`` (ok), or where its window is not steady (``unsteady``) a
        second one, asked the same (the same inputs, every run sampled and the same runs kept for
        the spot checks, which then check the second window) with ``quiet`` held, and the parent's
        clock over that ask alone (``spent``'s replacement). Unsteady again: ``contended``. On
        ``cuda`` only, as for the reference."""
        why = unsteady(Timing(**reply["timing"])) if self.device == "cuda" else None
        if why is None:
            return reply, spent
        again_spent = self._spent(cand.worker_pid)
        with self.quiet(), again_spent.during():
            again = cand.ask(ask, self.config.run_timeout_s)
        result.stderr += f"\n[kernelloop] the candidate's timing was not one steady window ({why}): timed again"
        if again.get("ok"):
            _unsteady_twice(result, "the candidate's timing", why, Timing(**again["timing"]))
        return again, again_spent

    def _time_again(self, ref: ReferenceWorker, timed: dict[str, Any], result: EvalResult,
                    compiled: bool = False) -> Timing:
        """The reference (its compiled module where ``compiled``) timed again with ``quiet`` held,
        counted in ``reference_retimed``."""
        result.reference_retimed += 1
        with self.quiet():
            return Timing(**ref.ask({**timed, "compiled": True} if compiled else timed)["timing"])

    def _one_window(self, ref: ReferenceWorker, timed: dict[str, Any], result: EvalResult, compiled: bool) -> bool:
        """A reference timing that is not one steady window (``sandbox.quiet.unsteady``: its median
        far above its own fastest run) is timed again, and kept from the second window; unsteady
        again: ``contended``. On ``cuda`` only (a shared CPU host's runs jump by themselves). Whether
        it was timed again."""
        attr = "compile_time" if compiled else "eager_time"
        first = getattr(result, attr)
        if self.device != "cuda" or first is None:
            return False
        why = unsteady(first)
        if why is None:
            return False
        again = self._time_again(ref, timed, result, compiled)
        setattr(result, attr, again)
        _unsteady_twice(result, f"the reference's {'compiled' if compiled else 'eager'} timing", why, again)
        return True

    def _steady(self, ref: ReferenceWorker, timed: dict[str, Any], result: EvalResult, compiled: bool = False,
                retimed: bool = False) -> None:
        """A reference time (eager, or its compiled module's where ``compiled``) far above the task's
        fastest so far (``TimingHistory.slower``) or off its running median is timed again; still so:
        ``contended``. The task's first one, which nothing is known to compare with, is timed twice (the
        second window with ``quiet`` held) and the faster kept: a launch-bound reference's whole window
        can run slow and steady (session w: up to 2.7x on a quiet host), and a task's first evaluation is
        its builtin's first candidate (``retimed``: ``_one_window`` took its second window already).
        The compiled time is held to it as the eager one is: in session ag (one H100) level2/82's
        first compiled window read 7.09 ms, steady, where its next three read
        3.83-3.85, and 59's fourth 6.96 after three of 5.33: each made its candidate's speedup against
        torch.compile 1.8x and 1.3x what the other evaluations measured. Each kind has its own history.
        On ``cuda`` only: a shared CPU host's timings jump by themselves (on 2 shared cores the suite's
        reference medians moved between 0.3 and 15 ms from one evaluation to the next), so there it would
        flag honest candidates; on ``cpu`` the candidate's processes are swept and its worker watched
        instead, and ``host_load`` records the host's load."""
        attr, kind = ("compile_time", "compiled") if compiled else ("eager_time", "eager")
        if self.history is None or getattr(result, attr) is None or self.device != "cuda":
            return
        label = self.config.numerics.label
        key = (result.task_sha256 or result.task, result.device_name, f"{label}/compiled" if compiled else label)
        if not self.history.known(key) and not retimed:
            again = self._time_again(ref, timed, result, compiled)
            if again.median_ms < getattr(result, attr).median_ms:
                setattr(result, attr, again)

        def off(t: Timing) -> Optional[str]:
            return self.history.slower(key, t.median_ms) or self.history.departure(key, t.median_ms, t.iqr_ms)

        why = off(getattr(result, attr))
        if why is not None:
            setattr(result, attr, self._time_again(ref, timed, result, compiled))
            again = off(getattr(result, attr))
            fastest = self.history.fastest_timing(key)
            if again is not None and self.history.slower(key, getattr(result, attr).median_ms) and fastest is not None:
                # slow but steady twice (sessions w and x: windows of a launch-bound reference 1.3-3.4x
                # slow for seconds, with the SM clock at its maximum and no other process on the GPU;
                # the harness's condition, not the candidate's): the task's fastest window stands in,
                # so the speedup is the lower one, as if measured in the reference's best condition
                result.stderr += (f"\n[kernelloop] the reference's {kind} time was far above the task's fastest twice "
                                  f"({why}; timed again: {again}): its fastest window ({fastest.median_ms:.4g} ms) "
                                  f"is used instead, so the speedup is the lower one")
                setattr(result, attr, fastest.model_copy(update={"from_earlier": True}))
            elif again is not None:
                result.add_flag(FlagKind.contended, f"the reference's {kind} time was off the task's earlier ones "
                                f"twice: {why}; timed again: {again}")
        t = getattr(result, attr)
        self.history.add(key, t.median_ms, t.iqr_ms, t)
