"""Candidate workers started ahead of their candidates, and the device gate that keeps
background reference work out of timed runs.

A candidate worker's start (Python, torch's import, the CUDA context, the profiler's first
session) costs seconds that do not depend on the candidate. ``WarmPool`` pays them in advance,
per slot, while candidates build: each worker is started with the ``warm`` message
(``sandbox.worker``), which carries nothing of any candidate. ``take`` hands one worker to one
candidate, with an output folder made for it at that moment; the worker is never handed out
again (the caller kills it after its candidate, as before). A warm worker found dead, or that
failed its warm-up, is thrown away and replaced: it is not the candidate's failure.

``DeviceGate``: work on a slot's device that needs no exclusivity (the reference precomputing a
trial while a candidate loads) may run beside other candidates' trials, but never while a
candidate is being timed.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from sandbox.failures import InfraFailure
from sandbox.process import WorkerDied, WorkerProcess, WorkerTimeout, outputs_root

WARM_TIMEOUT_S = 300.0
MAX_REPLACEMENTS = 3


class _Warm:
    """One pre-started worker: its process once spawned, and whether its warm-up answered."""

    def __init__(self) -> None:
        self.proc: Optional[WorkerProcess] = None
        self.done = threading.Event()
        self.error: Optional[str] = None
        self.seconds: Optional[float] = None

    def ok(self) -> bool:
        return self.error is None and self.proc is not None and self.proc.proc.poll() is None


class WarmPool:
    """Up to ``size`` warm candidate workers per slot. ``spawn(slot)`` starts a candidate
    worker process for the slot (its environment, its limits); ``warm_message`` is what each
    is told before its candidate is known."""

    def __init__(self, spawn: Callable[[int], WorkerProcess], warm_message: dict[str, Any], size: int,
                 timeout: float = WARM_TIMEOUT_S, background: Callable[[int], Any] = lambda slot: contextlib.nullcontext()):
        self._spawn, self._message, self.size, self.timeout = spawn, dict(warm_message), size, timeout
        self._background = background       # the slot's DeviceGate.background: warm-ups launch device work
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Warm]] = {}
        self._closed = False
        self.stats = {"started": 0, "taken_ready": 0, "taken_warming": 0, "taken_cold": 0, "replaced": 0}

    # ---------------------------------------------------------------- filling
    def prime(self, slot: int) -> None:
        """Start workers for ``slot`` until ``size`` are ready or warming (never blocks)."""
        with self._lock:
            if self._closed:
                return
            idle = self._idle.setdefault(slot, [])
            missing = self.size - len(idle)
            fresh = [_Warm() for _ in range(max(0, missing))]
            idle.extend(fresh)
        for w in fresh:
            threading.Thread(target=self._start, args=(slot, w), daemon=True, name="warm-worker").start()

    def _start(self, slot: int, w: _Warm) -> None:
        try:
            if self._closed:
                raise WorkerDied("the pool is closed", None)
            w.proc = self._spawn(slot)
            with self._lock:
                self.stats["started"] += 1
                closed = self._closed
            if closed:                  # closed while this one spawned: nobody will take or kill it
                w.proc.kill()
                w.proc.cleanup()
                raise WorkerDied("the pool is closed", None)
            with self._background(slot):
                reply = w.proc.ask({**self._message, "role": "warm"}, self.timeout)
            if not reply.get("ok"):
                w.error = str(reply.get("error_message") or "warm-up failed")
            w.seconds = reply.get("seconds")
        except (WorkerDied, WorkerTimeout, OSError) as exc:
            w.error = f"{type(exc).__name__}: {exc}"
        finally:
            w.done.set()

    # ---------------------------------------------------------------- taking
    def take(self, slot: int) -> WorkerProcess:
        """A warm worker for one candidate of ``slot``, never handed out before and never again.
        Ready ones first; else one still warming (waited for: it started earlier than a new one
        would); else one started now. Dead or failed ones are replaced, up to MAX_REPLACEMENTS."""
        for _ in range(MAX_REPLACEMENTS + 1):
            with self._lock:
                if self._closed:
                    raise WorkerDied("the sandbox was stopped (the run was interrupted)", None)
                idle = self._idle.setdefault(slot, [])
                ready = [w for w in idle if w.done.is_set()]
                w = (ready or idle or [None])[0]
                if w is not None:
                    idle.remove(w)
                    self.stats["taken_ready" if w.done.is_set() else "taken_warming"] += 1
            if w is None:
                w = _Warm()
                with self._lock:
                    self.stats["taken_cold"] += 1
                self._start(slot, w)
            self.prime(slot)            # its replacement warms while this candidate runs
            w.done.wait(self.timeout + 30.0)
            if w.ok():
                assert w.proc is not None
                self._fresh_out_dir(w.proc)
                return w.proc
            with self._lock:
                self.stats["replaced"] += 1
            if w.proc is not None:
                w.proc.kill()
                w.proc.cleanup()
        # before any candidate's code: the harness's failure (retried, then infra_error)
        raise InfraFailure(f"no candidate worker could be started, before the candidate's code ran ({w.error})",
                           "WorkerDied")

    @staticmethod
    def _fresh_out_dir(proc: WorkerProcess) -> None:
        """The folder the candidate's outputs go to, made now for this candidate alone."""
        old = proc.out_dir
        proc.out_dir = Path(tempfile.mkdtemp(prefix="kl-candidate-out-", dir=outputs_root()))
        shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiting = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
        for w in waiting:
            if w.proc is not None:
                w.proc.kill()
                w.proc.cleanup()


class DeviceGate:
    """Timing excludes background device work; background work (any number at once) waits
    while a timing runs or waits to run (timing first: it is on the critical path).

    A timing that finds background work running (a reference starting: its warm-up
    ``torch.compile`` takes 10-19 s at KernelBench's sizes) may let its slot go while that
    work ends (``timing(slot=lock)``): another candidate's trials use the slot meanwhile,
    where they used to wait behind a timing that waited."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._background = 0
        self._timing = 0

    def background(self) -> "_Held":
        return _Held(self, timing=False)

    def timing(self, slot: Optional[threading.Lock] = None) -> "_Held":
        """Held for a timing; ``slot`` (held by the caller) is let go, once, while background
        work already running ends, and held again before the timing is."""
        return _Held(self, timing=True, slot=slot)

    def busy(self) -> bool:
        with self._cond:
            return self._background > 0

    def _wait_idle(self, slot: threading.Lock) -> None:
        """``slot`` let go until no background work runs, then held again (never while holding
        the gate's own lock: a holder of the slot may be entering the gate)."""
        slot.release()
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._background == 0)
        finally:
            slot.acquire()

    def _enter(self, timing: bool) -> None:
        with self._cond:
            if timing:
                self._timing += 1
                self._cond.wait_for(lambda: self._background == 0)
            else:
                self._cond.wait_for(lambda: self._timing == 0)
                self._background += 1

    def _exit(self, timing: bool) -> None:
        with self._cond:
            if timing:
                self._timing -= 1
            else:
                self._background -= 1
            self._cond.notify_all()


class _Held:
    def __init__(self, gate: DeviceGate, timing: bool, slot: Optional[threading.Lock] = None):
        self.gate, self.is_timing, self.slot = gate, timing, slot

    def __enter__(self) -> "_Held":
        if self.slot is not None and self.gate.busy():
            # not registered as a timing while the slot is let go: background work may start
            # meanwhile, and the timing then waits for it holding the slot, as before
            self.gate._wait_idle(self.slot)
        self.gate._enter(self.is_timing)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gate._exit(self.is_timing)
