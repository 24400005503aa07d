"""Candidate workers started ahead of their candidates, and the device gate that keeps
background reference work out of timed runs.

A candidate worker's start (Python, torch's import, the CUDA context, the profiler's first
session) costs seconds that do not depend on the candidate. ``WarmPool`` pays them in advance,
per slot, while candidates build: each worker is started with the ``warm`` message
(``sandbox.worker``), which carries nothing of any candidate. ``take`` hands one worker to one
candidate, with an output folder made for it at that moment; the worker is never handed out
again (the caller kills it after its candidate, as before). A warm worker found dead, or that
failed its warm-up, is thrown away and replaced: it is not the candidate's failure. The sandbox
keeps build workers warm the same way (``BUILD_WARM_MESSAGE``): a build's first seconds were
torch's import.

``DeviceGate``: work on a slot's device that needs no exclusivity (the reference precomputing a
trial while a candidate loads) may run beside other candidates' trials, but never while a
candidate is being timed.
"""
from __future__ import annotations

import contextlib
import signal
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from sandbox.failures import InfraFailure
from sandbox.process import WorkerDied, WorkerProcess, WorkerTimeout, outputs_root

WARM_TIMEOUT_S = 300.0
MAX_REPLACEMENTS = 3
# A build worker started ahead (``Sandbox``'s build pool): the GPU hidden, nothing but Python's,
# torch's and the build hook's imports paid before its one candidate (``sandbox.worker.serve``).
BUILD_WARM_MESSAGE = {"device": "cpu", "profile": False, "serves": "build"}


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
                 timeout: float = WARM_TIMEOUT_S, background: Callable[[int], Any] = lambda slot: contextlib.nullcontext(),
                 turns: bool = False):
        self._spawn, self._message, self.size, self.timeout = spawn, dict(warm_message), size, timeout
        self._background = background       # the slot's DeviceGate.background: warm-ups launch device work
        # held around the warm-up's kernels only (the worker asks: WorkerProcess.ask's device_turns),
        # else around the whole warm-up (the CPU target: its imports share the timed runs' cores)
        self._turns = turns
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Warm]] = {}
        self._closed = False
        self.stats = {"started": 0, "taken_ready": 0, "taken_warming": 0, "taken_cold": 0, "replaced": 0}
        self._ready_s: list[float] = []     # each warm-up, spawn to ready (imports and device turns included)
        self._own_s: list[float] = []       # each warm-up as its worker timed it (after its imports)

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

    def summary(self) -> dict[str, Any]:
        """``stats``, and the median seconds of a warm-up from its spawn to ready and as its worker
        timed it: where the two differ, the warm-up waited (for cores, imports, device turns)."""
        import statistics

        with self._lock:
            ready, own = list(self._ready_s), list(self._own_s)
        return {**self.stats, **({"ready_median_s": round(statistics.median(ready), 2)} if ready else {}),
                **({"own_median_s": round(statistics.median(own), 2)} if own else {})}

    def _start(self, slot: int, w: _Warm) -> None:
        spawned = time.monotonic()
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
            message = {**self._message, "role": "warm"}
            if self._turns:
                reply = w.proc.ask(message, self.timeout, device_turns=lambda: self._background(slot))
            else:
                with self._background(slot):
                    reply = w.proc.ask(message, self.timeout)
            if not reply.get("ok"):
                w.error = str(reply.get("error_message") or "warm-up failed")
            w.seconds = reply.get("seconds")
            with self._lock:
                self._ready_s.append(time.monotonic() - spawned)
                if w.seconds is not None:
                    self._own_s.append(float(w.seconds))
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


class BuildPause:
    """The build workers running now, stopped (SIGSTOP to each one's process group: the worker and
    its compiler) while a timing on the CPU target is held, and continued after. On a 2-core host a
    compiler beside the timed runs made them meaningless: eager medians of one task moved between
    0.55 and 1.17 ms from one evaluation to the next, with IQRs up to 8 ms. A build that starts
    while a timing is held is stopped as it starts. Time spent stopped is the harness's, not the
    candidate's: ``ask`` gives a build its whole timeout besides it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[WorkerProcess, float] = {}     # worker -> seconds stopped so far
        self._held = 0
        self._since: dict[WorkerProcess, float] = {}       # stopped since (while held)

    def add(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._running[worker] = 0.0
            if self._held:
                self._since[worker] = time.monotonic()
                worker.signal_group(signal.SIGSTOP)

    def discard(self, worker: WorkerProcess) -> None:
        with self._lock:
            self._running.pop(worker, None)
            if self._since.pop(worker, None) is not None:
                worker.signal_group(signal.SIGCONT)    # ended (or to be killed): never left stopped

    def stopped_s(self, worker: WorkerProcess) -> float:
        with self._lock:
            since = self._since.get(worker)
            return self._running.get(worker, 0.0) + (time.monotonic() - since if since is not None else 0.0)

    def ask(self, worker: WorkerProcess, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """``worker.ask`` with ``timeout`` counted without the time the worker was stopped."""
        worker.send(payload)
        started = time.monotonic()
        while True:
            left = timeout + self.stopped_s(worker) - (time.monotonic() - started)
            if left <= 0:
                raise WorkerTimeout(f"the {worker.role} worker did not answer within {timeout:.0f} s", worker.role)
            try:
                return worker.recv(min(left, 5.0))
            except WorkerTimeout:
                continue        # its deadline again, moved by any time it was stopped meanwhile

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._held += 1
            if self._held == 1:
                now = time.monotonic()
                for w in self._running:
                    self._since[w] = now
                    w.signal_group(signal.SIGSTOP)
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                if self._held == 0:
                    now = time.monotonic()
                    for w, since in self._since.items():
                        self._running[w] = self._running.get(w, 0.0) + now - since
                        w.signal_group(signal.SIGCONT)
                    self._since.clear()


class DeviceGate:
    """Timing excludes background device work; background work (any number at once) waits
    while a timing runs or waits to run (timing first: it is on the critical path).

    A timing that finds background work running (a reference starting: its warm-up
    ``torch.compile`` takes 10-19 s at KernelBench's sizes) may let its slot go while that
    work ends (``timing(slot=...)``, a ``SlotLock``): another candidate's trials use the slot
    meanwhile, where they used to wait behind a timing that waited (6-11 s per GEMM candidate
    on an H100). New background work waits from the moment a timing asks, slot let go or not."""

    def __init__(self, quiet: Optional[Callable[[], Any]] = None) -> None:
        self._cond = threading.Condition()
        self._background = 0
        self._timing = 0
        self._quiet = quiet         # a context held inside every timing (the CPU target: builds paused)
        # per kind of hold ("timing", or the background work's kind): how many, seconds waited to
        # enter, seconds held; a slow run shows which work held its timings back, and which waited
        self.account: dict[str, dict[str, float]] = {}

    def background(self, abandon: Optional[threading.Event] = None, kind: str = "other") -> "_Held":
        """Held for background work of ``kind`` (accounted under that name); where ``abandon``
        is set while it still waits (``wake``), it is not entered (``entered`` False)."""
        return _Held(self, timing=False, abandon=abandon, kind=kind)

    def _count(self, kind: str, waited: float, held: float) -> None:
        with self._cond:
            row = self.account.setdefault(kind, {"n": 0, "wait_s": 0.0, "held_s": 0.0})
            row["n"] += 1
            row["wait_s"] += waited
            row["held_s"] += held

    def wake(self) -> None:
        """Waiters look at their ``abandon`` events again."""
        with self._cond:
            self._cond.notify_all()

    def timing(self, slot: Optional["SlotLock"] = None) -> "_Held":
        """Held for a timing; ``slot`` (held by the caller) is let go while background work
        already running ends, and taken back, ahead of candidates arriving at the slot, before
        the timing is held."""
        return _Held(self, timing=True, slot=slot)

    def _enter(self, timing: bool, slot: Optional["SlotLock"] = None,
               abandon: Optional[threading.Event] = None) -> bool:
        with self._cond:
            if not timing:
                self._cond.wait_for(lambda: self._timing == 0 or (abandon is not None and abandon.is_set()))
                if self._timing and abandon is not None and abandon.is_set():
                    return False
                self._background += 1
                return True
            # registered at once: no background work starts from now on, so the wait is bounded
            # by what runs already, and a stream of warm-ups and loads cannot starve the timing
            self._timing += 1
            if slot is None or self._background == 0:
                self._cond.wait_for(lambda: self._background == 0)
                return True
        # The slot goes to another candidate's trials meanwhile. Not under the gate's own lock: a
        # holder of the slot may be entering the gate. Nothing holding a slot waits for background
        # work to start (a trial-0 precompute still at the gate is abandoned: Precomputed.wait).
        slot.release()
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._background == 0)
        finally:
            slot.acquire(first=True)
        return True

    def _exit(self, timing: bool) -> None:
        with self._cond:
            if timing:
                self._timing -= 1
            else:
                self._background -= 1
            self._cond.notify_all()


def gate_account(gates: list[DeviceGate]) -> dict[str, dict[str, float]]:
    """Several slots' gates summed by kind of hold: how many, seconds waited, seconds held."""
    total: dict[str, dict[str, float]] = {}
    for gate in gates:
        with gate._cond:
            rows = {k: dict(v) for k, v in gate.account.items()}
        for kind, row in rows.items():
            into = total.setdefault(kind, {"n": 0, "wait_s": 0.0, "held_s": 0.0})
            for key, value in row.items():
                into[key] += value
    return {k: {key: round(v, 1) for key, v in row.items()} for k, row in sorted(total.items())}


class SlotLock:
    """A slot's exclusive hold (trials, timing, spot checks of one candidate at a time). A
    candidate that let it go while its timing waited takes it back first (``acquire(first=True)``),
    ahead of candidates arriving for their trials: otherwise it queued behind all of them (on an
    H200, 50-125 s)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._first = 0

    def acquire(self, first: bool = False) -> None:
        with self._cond:
            if first:
                self._first += 1
            try:
                self._cond.wait_for(lambda: not self._held and (first or self._first == 0))
            finally:
                if first:
                    self._first -= 1
            self._held = True

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of a slot not held")
            self._held = False
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> "SlotLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _Held:
    def __init__(self, gate: DeviceGate, timing: bool, slot: Optional["SlotLock"] = None,
                 abandon: Optional[threading.Event] = None, kind: str = "other"):
        self.gate, self.is_timing, self.slot, self.abandon = gate, timing, slot, abandon
        self.kind = "timing" if timing else kind
        self.entered = False
        self._quiet: Optional[contextlib.ExitStack] = None
        self._asked = self._began = 0.0

    def __enter__(self) -> "_Held":
        self._asked = time.monotonic()
        try:
            self.entered = self.gate._enter(self.is_timing, self.slot, self.abandon)
            self._began = time.monotonic()
            if self.entered and self.is_timing and self.gate._quiet is not None:
                self._quiet = contextlib.ExitStack()
                self._quiet.enter_context(self.gate._quiet())
        except BaseException:
            if self.is_timing:
                self.gate._exit(True)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
        if self.entered:
            self.gate._exit(self.is_timing)
            self.gate._count(self.kind, self._began - self._asked, time.monotonic() - self._began)
