"""The device's clock: how one call is timed on cuda (events) and cpu (a monotonic clock).

``time_samples`` is the one timing loop every figure comes from (reference eager, reference
torch.compile, candidates, the device probe); ``sandbox.timing.time_runs`` summarises its
samples into a ``Timing``.

Policy (GPU), for each timed run after the warm-up runs:

1. fresh input buffers, made before anything is timed;
2. a *device-wide* synchronize: the previous run's work, side streams included, is done;
3. queued ahead of the start event: the L2 flush (a write of a buffer larger than L2) and a
   short spin of the GPU (``torch.cuda._sleep``), so the GPU is still busy when the call's
   first kernel arrives and the CPU's launch latency is not on the clock (steps 2 and 3 are
   ``preamble``, which the profile runs too: work of a call that starts before the preamble
   ended, on a side stream that does not wait for the caller's, is flagged there);
4. the start event, the call, the end event, on the stream that was current before the call;
5. a device-wide synchronize, then a third event: its distance from the end event is the
   synchronize's own latency (calibrated before the runs) unless work the call left on a
   stream it did not join to ours ran past the end event. The later of the two ends counts,
   so unjoined side-stream work stays on the clock.

CPU: the same policy with a monotonic clock and a buffer larger than the last-level cache; the
process's minor page faults are read just outside each timed call (``faults``: the harness's own
allocations between runs must not move the call onto fresh pages; ``Timing.page_faults``).

The clock and synchronize functions are bound when this module is imported (before any
candidate code runs in a worker), so a candidate that later patches ``time`` or
``torch.cuda`` does not change what this module calls.
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

_perf_counter_ns = time.perf_counter_ns
_getrusage = resource.getrusage
_RUSAGE_SELF = resource.RUSAGE_SELF
_cuda_sync = getattr(torch._C, "_cuda_synchronize", None)
_Event = torch.cuda.Event
_elapsed_time = torch.cuda.Event.elapsed_time
_record = torch.cuda.Event.record
_current_stream = torch.cuda.current_stream
_spin = getattr(torch.cuda, "_sleep", None)      # a kernel that spins the GPU for a number of cycles


def _snapshot() -> Callable[[], dict[str, Any]]:
    bound = {"_perf_counter_ns": _perf_counter_ns, "_cuda_sync": _cuda_sync, "_Event": _Event,
             "_elapsed_time": _elapsed_time, "_record": _record, "_current_stream": _current_stream, "_spin": _spin}
    return lambda: dict(bound)


_bound = _snapshot()     # what this module's own names were bound to at import (held in a closure)

CPU_FLUSH_BYTES = 64 << 20
GPU_FLUSH_BYTES = 256 << 20   # > 2x the largest L2 on the devices we target (H100 50 MB, H200 50 MB)
AHEAD_MS = 0.2                # GPU work queued ahead of the start event, beyond the flush
CALIBRATION_RUNS = 10         # rounds that measure the synchronize's own latency


def original_functions() -> dict[str, Any]:
    """What the timing code relies on; the worker checks these are unchanged after a candidate ran."""
    bound = _bound()
    this = sys.modules[__name__]
    return {"time.perf_counter_ns": (time, "perf_counter_ns", bound["_perf_counter_ns"]),
            "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time", bound["_elapsed_time"]),
            "torch.cuda.Event.record": (torch.cuda.Event, "record", bound["_record"]),
            "torch._C._cuda_synchronize": (torch._C, "_cuda_synchronize", bound["_cuda_sync"]),
            # the clock's own bindings (a candidate that imports this module and rebinds them)
            **{f"hardware.clock.{name}": (this, name, value) for name, value in bound.items()},
            # the preamble the profile runs too (a no-op in its place would hide work ahead of the clock)
            "hardware.clock.preamble": (this, "preamble", _preamble())}


def tampered_functions() -> list[str]:
    return [name for name, (owner, attr, orig) in original_functions().items()
            if orig is not None and getattr(owner, attr, None) is not orig]


def device_sync(device: str) -> None:
    if device == "cuda":
        _cuda_sync()


class L2Flusher:
    def __init__(self, device: str, enabled: bool = True):
        self.enabled = enabled
        self.buffer = None
        if enabled:
            nbytes = GPU_FLUSH_BYTES if device == "cuda" else CPU_FLUSH_BYTES
            self.buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


class _Spin:
    """``torch.cuda._sleep`` for about ``ms`` milliseconds (its cycles per millisecond measured once)."""

    cycles_per_ms: Optional[float] = None

    def __call__(self, ms: float) -> None:
        if _spin is None or ms <= 0:
            return
        if _Spin.cycles_per_ms is None:
            a, b = _Event(enable_timing=True), _Event(enable_timing=True)
            _spin(1_000_000)                     # first launch loads the kernel
            _record(a)
            _spin(1_000_000)
            _record(b)
            _cuda_sync()
            _Spin.cycles_per_ms = 1_000_000 / max(_elapsed_time(a, b), 1e-3)
        _spin(int(ms * _Spin.cycles_per_ms))


def sync_latency_ms(runs: int = CALIBRATION_RUNS) -> float:
    """Time from an end event on a busy stream to an event recorded after the device-wide
    synchronize that waited for it, with no other work: the second largest of ``runs``
    rounds, so the host's jitter rarely puts a run's own latency above it."""
    spin = _Spin()
    gaps = []
    end, after = _Event(enable_timing=True), _Event(enable_timing=True)
    for _ in range(runs):
        _cuda_sync()
        spin(0.05)
        stream = _current_stream()
        _record(end, stream)
        _cuda_sync()
        _record(after, stream)
        _cuda_sync()
        gaps.append(_elapsed_time(end, after))
    gaps.sort()
    return gaps[-2] if len(gaps) > 1 else gaps[0]


def preamble(flusher: L2Flusher, spin: Optional[_Spin] = None) -> Any:
    """What precedes each timed call on cuda (steps 2 and 3 of the policy): a device-wide
    synchronize, then the L2 flush and the spin queued on the current stream, which is returned;
    the start event goes on it next. ``sandbox.profiling`` runs the same preamble before each
    profiled forward to see whether any of the forward's work started before its end, i.e. before
    the start event (a side stream that never waits for the caller's stream)."""
    _cuda_sync()
    stream = _current_stream()
    flusher()
    (spin or _Spin())(AHEAD_MS)
    return stream


_preamble = (lambda original: lambda: original)(preamble)     # held in a closure, like _bound


def time_samples(fn: Callable[..., Any], make_args: Callable[[int], Sequence[Any]], device: str,
                 warmup: int = 3, runs: int = 20, flush_l2: bool = True,
                 on_output: Optional[Callable[[int, Any], None]] = None,
                 faults: Optional[list[int]] = None) -> tuple[list[float], str]:
    """Milliseconds of ``fn(*make_args(i))`` for each of ``runs`` runs, and the clock's name.
    ``faults`` (cpu): gets each timed call's minor page faults (the process's, read outside the clock).

    ``make_args`` is called outside the timed region, so generating inputs costs nothing
    on the clock, and at most one argument set is alive at a time. ``on_output(i, out)``
    sees each timed run's result after its clock stopped (the sandbox spot-checks some).
    """
    flusher = L2Flusher(device, flush_l2)
    samples: list[float] = []
    with torch.no_grad():
        for i in range(warmup):
            fn(*make_args(runs + i))
        device_sync(device)
        if device == "cuda":
            spin = _Spin()
            latency = sync_latency_ms()
            start, end, after = (_Event(enable_timing=True) for _ in range(3))
            for i in range(runs):
                args = tuple(make_args(i))
                stream = preamble(flusher, spin)
                _record(start, stream)
                out = fn(*args)
                _record(end, stream)
                _cuda_sync()
                _record(after, stream)
                _cuda_sync()
                samples.append(max(_elapsed_time(start, end), _elapsed_time(start, after) - latency))
                if on_output is not None:
                    on_output(i, out)
                del args, out
            return samples, "cuda_event"
        for i in range(runs):
            args = tuple(make_args(i))
            flusher()
            f0 = _getrusage(_RUSAGE_SELF).ru_minflt if faults is not None else 0
            t0 = _perf_counter_ns()
            out = fn(*args)
            samples.append((_perf_counter_ns() - t0) / 1e6)
            if faults is not None:
                faults.append(_getrusage(_RUSAGE_SELF).ru_minflt - f0)
            if on_output is not None:
                on_output(i, out)
            del args, out
    return samples, "perf_counter"
