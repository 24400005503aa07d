"""Proof that the device was quiet while timing, or a ``contended`` flag.

Three observations around each evaluation's timing (``sandbox.checks``):

* **the candidate's processes**: before the reference is timed the candidate's worker tree is
  swept (``sandbox.keeper``: every process but the idle worker is killed and counted), and the
  worker's own CPU time is read before and after the reference's timing window: an idle worker
  uses none, so one that ran while the reference was timed (threads of its own, loading the CPU
  or the device) is ``suspicious``;
* **the GPU** (``cuda`` only, through NVML: ``nvidia-ml-py``, optional): before and after each
  timed window, compute processes on the slot's GPU that are not this sandbox's own, and any
  process but the worker being timed that used the GPU's SMs during the window (another
  candidate loading on the slot included), make the timing ``contended``; the candidate's worker
  using the SMs while the reference is timed is also ``suspicious``. An SM sample tells the use
  over the driver's sample period *before* its time stamp, so a sample stamped within one period
  of the window's start also covers work done before the window (the trials, the other worker's
  timed runs): it is not the window's and is not judged. A window starts once the timing holds the slot's device (``timing_window``), after any
  background work it waited for;
* **a running median** per task, device and numerics (``cuda`` only: a shared CPU host's
  timings jump by themselves): a reference median (eager, or compiled in a history of its own)
  that departs from its running median by more than the measured spread is timed again; if it stays
  off, the evaluation is ``contended`` (``sandbox.steady``);
* **a steady window** (``cuda`` only): a reference timing (eager or compiled) or the candidate's
  whose median is more than ``UNSTEADY_RATIO`` times its own fastest run is timed again (with the
  same ask: ``sandbox.steady``); unsteady again: the evaluation is ``contended``. On four H200 lanes (sessions u and v) 95% of reference medians were
  within 5% of their fastest run, and about 2% were 1.3-3.4x it without any other flag: runs
  2-5x slower for 30-100 ms inside the window (as if one to four other jobs shared the GPU),
  where NVML saw no other process, and a task's first evaluations have no running median yet.
  Such a window made level2/75's eager 6.16 ms against 3.09 in its other three evaluations,
  and a clean "2.89x" that was 1.46x.

A contended timing never yields a clean speedup (``EvalResult.clean``).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections import deque
from typing import Any, Iterator, Iterable, Optional

from sandbox.containment import descendants, process_table, tree_cpu_seconds

HISTORY = 15                   # medians kept per task, device and kind
MIN_HISTORY = 3                # medians needed before a departure is judged
REL_FLOOR = 0.10               # a departure below this fraction of the running median is never one
IDLE_CPU_S = 0.10              # CPU seconds an idle worker may use while the reference is timed ...
IDLE_CPU_SHARE = 0.10          # ... or this share of the reference's timing wall time, if more


UNSTEADY_RATIO = 1.25          # a reference median this far above its fastest run is timed again ...
UNSTEADY_MIN_MS = 0.02         # ... where it is also this much above it (launch jitter of tiny tasks is not)
UNSTEADY_MIN_RUNS = 5


def _far_above(median_ms: float, fastest_ms: Optional[float]) -> bool:
    """Whether a median is more than ``UNSTEADY_RATIO`` times ``fastest_ms`` and ``UNSTEADY_MIN_MS`` above it."""
    return (fastest_ms is not None and fastest_ms > 0 and median_ms > UNSTEADY_RATIO * fastest_ms
            and median_ms - fastest_ms > UNSTEADY_MIN_MS)


def unsteady(timing: Any) -> Optional[str]:
    """Why ``timing`` (a ``sandbox.result.Timing``) is not one steady window (see the module's
    docstring), or None."""
    samples = list(getattr(timing, "samples_ms", None) or [])
    if len(samples) < UNSTEADY_MIN_RUNS:
        return None
    fastest, median = min(samples), float(timing.median_ms)
    if not _far_above(median, fastest):
        return None
    slow = sum(1 for x in samples if x > UNSTEADY_RATIO * fastest)
    return (f"median {median:.4g} ms, {median / fastest:.2f}x its fastest run ({fastest:.4g} ms); "
            f"{slow} of {len(samples)} runs over {UNSTEADY_RATIO}x it")


def slower(median_ms: float, fastest_ms: Optional[float]) -> Optional[str]:
    """Why a reference median is far above the fastest median of the same task seen before
    (``UNSTEADY_RATIO`` and ``UNSTEADY_MIN_MS``, as for one window's runs), or None."""
    if not _far_above(median_ms, fastest_ms):
        return None
    return f"median {median_ms:.4g} ms, {median_ms / fastest_ms:.2f}x the task's fastest median so far ({fastest_ms:.4g} ms)"


class TimingHistory:
    """Running medians of reference timings, per (task, device, kind), and the fastest of each.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._medians: dict[tuple[str, str, str], deque[tuple[float, float]]] = {}
        # the fastest median of each key, with its ``Timing`` where one was given
        self._fastest: dict[tuple[str, str, str], tuple[float, Any]] = {}

    def known(self, key: tuple[str, str, str]) -> bool:
        """Whether a median of ``key`` was recorded."""
        with self._lock:
            return key in self._fastest

    def slower(self, key: tuple[str, str, str], median_ms: float) -> Optional[str]:
        """Why ``median_ms`` is far above the fastest median recorded for ``key`` (module's ``slower``).
        A launch-bound reference's whole window can run 1.3-3.4x slow and still be steady (session w's
        level-3 lanes: 28_VisionTransformer 13.3 ms seconds after 3.9 ms), which neither
        ``unsteady`` nor the running median (three evaluations needed) sees."""
        with self._lock:
            fastest = self._fastest[key][0] if key in self._fastest else None
        return slower(median_ms, fastest)

    def departure(self, key: tuple[str, str, str], median_ms: float, iqr_ms: float) -> Optional[str]:
        """Why ``median_ms`` is off its running median (None where it is not, or too few are known).
        The spread allowed is the largest of: 3 median absolute deviations of the medians seen, the
        typical IQR of the runs seen, this timing's own IQR, and ``REL_FLOOR`` of the running median."""
        with self._lock:
            seen = list(self._medians.get(key, ()))
        if len(seen) < MIN_HISTORY:
            return None
        medians = [m for m, _ in seen]
        centre = statistics.median(medians)
        mad = statistics.median(abs(x - centre) for x in medians)
        spread = max(3.0 * mad, statistics.median(q for _, q in seen), iqr_ms, REL_FLOOR * centre)
        if abs(median_ms - centre) <= spread:
            return None
        return (f"median {median_ms:.4g} ms, running median {centre:.4g} ms over {len(seen)} evaluations "
                f"(spread {spread:.3g} ms)")

    def fastest_timing(self, key: tuple[str, str, str]) -> Any:
        """The ``Timing`` of the fastest median recorded for ``key`` (None where none was, or it was
        recorded without its timing)."""
        with self._lock:
            return self._fastest[key][1] if key in self._fastest else None

    def add(self, key: tuple[str, str, str], median_ms: float, iqr_ms: float = 0.0, timing: Any = None) -> None:
        with self._lock:
            self._medians.setdefault(key, deque(maxlen=HISTORY)).append((median_ms, iqr_ms))
            if median_ms > 0 and median_ms <= self._fastest.get(key, (median_ms, None))[0]:
                self._fastest[key] = (median_ms, timing)


class IdleWatch:
    """The CPU time a worker (and its tree) uses over a window in which it should be idle."""

    def __init__(self, pid: Optional[int]):
        self.pid = pid
        self.t0 = time.monotonic()
        self.cpu0 = tree_cpu_seconds(pid) if pid else 0.0

    def busy(self) -> Optional[str]:
        if not self.pid:
            return None
        used = tree_cpu_seconds(self.pid) - self.cpu0
        wall = time.monotonic() - self.t0
        if used <= max(IDLE_CPU_S, IDLE_CPU_SHARE * wall):
            return None
        return f"its worker used {used:.2f} s of CPU during the {wall:.2f} s the reference was timed (it should be idle)"


# ---------------------------------------------------------------- the GPU, through NVML
_NVML: Any = None
_NVML_LOCK = threading.Lock()


def _nvml() -> Any:
    """pynvml (nvidia-ml-py) initialised, or None where it is not installed or no driver answers."""
    global _NVML
    with _NVML_LOCK:
        if _NVML is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _NVML = pynvml
            except Exception:  # noqa: BLE001 - optional: the check is then skipped, and said so
                _NVML = False
        return _NVML or None


SAMPLE_PERIOD_US = 1_000_000   # the SM sample period assumed where NVML does not show it (longer is safer)
_PERIODS: dict[str, int] = {}


def sample_period_us(nv: Any, handle: Any, key: str) -> int:
    """The driver's utilization sample period on this GPU (``key``: its index or UUID) in
    microseconds: the median step between the time stamps of its buffered device samples;
    ``SAMPLE_PERIOD_US`` where NVML gives too few. Found once per GPU and process."""
    if key in _PERIODS:
        return _PERIODS[key]
    period = SAMPLE_PERIOD_US
    try:
        _, samples = nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
        stamps = sorted({int(x.timeStamp) for x in samples})
        steps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
        if len(steps) >= 3:
            period = int(min(max(statistics.median(steps), 10_000), 5 * SAMPLE_PERIOD_US))
    except Exception:  # noqa: BLE001 - not supported on this GPU or driver: the safe default
        pass
    _PERIODS[key] = period
    return period


def latest_stamp(nv: Any, handle: Any) -> Optional[int]:
    """The newest time stamp among the samples NVML holds now (per-process SM samples and the
    device's utilization samples), on NVML's own clock; None where it shows none. A sample stamped
    later than this was taken after the call."""
    stamps: list[int] = []
    try:
        stamps += [int(s.timeStamp) for s in nv.nvmlDeviceGetProcessUtilization(handle, 0)]
    except Exception:  # noqa: BLE001 - none buffered, or not supported: the host's clock alone judges
        pass
    try:
        _, samples = nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
        stamps += [int(x.timeStamp) for x in samples]
    except Exception:  # noqa: BLE001
        pass
    return max(stamps) if stamps else None


class GpuWatch:
    """One slot's GPU: foreign compute processes and foreign SM use over a timed window.

    A window's start is known on two clocks: the host's (``since``) and NVML's (``base``: the newest
    stamp NVML held when the window began). On session ag's H100, samples read within a few
    milliseconds of a window's start were stamped 245-1,018 ms after it by the host's clock, so
    samples of the work just before the window (the evaluation's own trials and timed runs) could
    be judged the window's, and 22 of 400 honest evaluations were flagged for the SM use of a worker
    of their own run. Whether NVML's clock runs ahead is not settled: session ah's
    ``scripts/nvml_lag.py`` read its newest stamp a median 95 ms behind the host's clock (at most
    81 ms ahead, sample period 200 ms); the rule below costs nothing where it does not. A sample tells the use over
    the period before its stamp, and the next sample after ``base`` may cover up to a period before
    the window began: only samples stamped after both ``since`` plus a period and ``base`` plus two
    are judged."""

    def __init__(self, gpu: Optional[str]):
        self.nvml = _nvml()
        self.handle = None
        self.note: Optional[str] = None
        self.unread: Optional[str] = None      # why a window's SM samples could not be read, if they could not
        if self.nvml is None:
            self.note = "NVML unavailable (nvidia-ml-py not installed or no driver): the GPU was not watched"
            return
        try:
            ident = self.ident = (gpu or "0").strip()
            self.handle = (self.nvml.nvmlDeviceGetHandleByIndex(int(ident)) if ident.isdigit()
                           else self.nvml.nvmlDeviceGetHandleByUUID(ident))
        except Exception as exc:  # noqa: BLE001
            self.note = f"NVML could not open GPU {gpu!r} ({type(exc).__name__}): the GPU was not watched"
        self.base: Optional[int] = None
        self.since = int(time.time() * 1e6)         # SM use is judged from here on, window by window
        self.start()

    def start(self) -> None:
        if self.handle is not None:
            self.since = int(time.time() * 1e6)
            self.base = latest_stamp(self.nvml, self.handle)

    def foreign(self, own_root: int, allowed: Iterable[Optional[int]] = (),
                workers: Iterable[int] = ()) -> list[tuple[int, str]]:
        """Compute processes on this GPU that are neither this sandbox nor below it, and SM use
        since ``start`` by any process but the ``allowed`` pids (the worker being timed); each
        ``(pid, description)``. Empty where NVML is unavailable. Starts the next window.

        ``workers``: the workers this sandbox started, alive or ended (``sandbox.process.worker_pids``).
        The driver lists a worker, with its memory, while it tears the worker's CUDA context down,
        after the worker left this sandbox's process tree. On two H100s, 3 of 78 honest builtin
        candidates were flagged ``contended`` by processes of their own run no longer in its tree
        ("pid N holds 636 MiB on the GPU": a bare CUDA context; "1492 MiB": a released reference's,
        by its size); counting only the workers the sandbox killed, 4 of 40 on one H100 still were
        (references closed by a request to exit, candidates that ended by themselves). Such a
        listing is not judged; their SM use still is (a kernel still running would disturb the timing)."""
        if self.handle is None:
            return []
        nv = self.nvml
        workers = set(workers)
        ours = {own_root} | descendants(own_root, process_table()) | workers
        allowed = {p for p in allowed if p}
        found: list[tuple[int, str]] = []
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid not in ours:
                    found.append((p.pid, f"pid {p.pid} holds {int(p.usedGpuMemory or 0) >> 20} MiB on the GPU"))
        except Exception:  # noqa: BLE001
            pass
        try:
            period = sample_period_us(nv, self.handle, self.ident)
            # samples stamped earlier began before the window, by either clock
            first = self.since + period if self.base is None else max(self.since + period, self.base + 2 * period)
            for s in nv.nvmlDeviceGetProcessUtilization(self.handle, self.since):
                if s.pid not in allowed and s.smUtil > 0 and int(s.timeStamp) > first:
                    # when, on both clocks, so that a flag can be told from a sample period longer than
                    # the device's (session ad, one H200: 4 of 200 evaluations of rounds 0-1 and 16 of 200
                    # of rounds 2-3 flagged so) or from NVML's clock running ahead (session ag)
                    after_base = ("" if self.base is None else
                                  f", {(int(s.timeStamp) - self.base) / 1000:.0f} ms after NVML's newest sample then")
                    found.append((s.pid, f"pid {s.pid}{_whose(s.pid, workers)} used {s.smUtil}% of the SMs "
                                         f"(a sample stamped {(int(s.timeStamp) - self.since) / 1000:.0f} ms "
                                         f"into the window by the host's clock{after_base}; "
                                         f"sample period {period / 1000:.0f} ms)"))
        except Exception as exc:  # noqa: BLE001
            # NVML's own error (not supported, no sample since `since`) is expected; anything else is
            # the harness's fault and is said, not swallowed (a TypeError here once skipped every check)
            if not isinstance(exc, getattr(nv, "NVMLError", ())):
                self.unread = f"the GPU's SM use was not judged ({type(exc).__name__}: {exc})"
        self.start()
        return found


def _whose(pid: int, workers: set[int]) -> str:
    """`` (a worker of this run, running|ended)`` for one of the sandbox's own workers, else ``""``:
    a worker that ended before the check cannot have run during the window, yet the driver may
    stamp its last sample late (a reason to tell apart before the rule changes)."""
    if pid not in workers:
        return ""
    return f" (a worker of this run, {'running' if os.path.exists(f'/proc/{pid}') else 'ended'})"


@contextlib.contextmanager
def timing_window(gate: Any, gpu: Optional[str], device: str, slot: Any = None) -> Iterator[Optional[GpuWatch]]:
    """The slot's device held for timing (``gate``: a ``DeviceGate``'s ``timing()``, or None;
    ``slot``: the slot's lock, let go while the gate waits for background work), and
    the GPU watched from the moment it is held. A watch started before the gate was held would
    count the background work the gate waited for (a warm worker warming up, a reference
    starting) as use during the window: on an H100 that flagged every honest candidate
    ``contended`` ("not quiet before the timed runs: pid N used 1% of the SMs")."""
    with (gate.timing(slot) if gate is not None else contextlib.nullcontext()):
        yield GpuWatch(gpu) if device == "cuda" else None
