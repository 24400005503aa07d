"""One timing routine for everything: reference eager, reference torch.compile, candidates.

Policy (GPU): warm-up runs, then for each timed run: fresh input buffers (made before the
clock starts), the L2 cache flushed by writing a buffer larger than it, a CUDA event
recorded, the call, a *device-wide* synchronize (so work left on side streams is
counted), a second event; median and IQR of the event times. CPU: the same policy with a
monotonic clock and a buffer larger than the last-level cache.

The clock and synchronize functions are bound when this module is imported (before any
candidate code runs in a worker), so a candidate that later patches ``time`` or
``torch.cuda`` does not change what this module calls.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from sandbox.result import Timing

_perf_counter_ns = time.perf_counter_ns
_cuda_sync = getattr(torch._C, "_cuda_synchronize", None)
_Event = torch.cuda.Event
_elapsed_time = torch.cuda.Event.elapsed_time
_record = torch.cuda.Event.record

CPU_FLUSH_BYTES = 64 << 20
MAX_SAMPLES = 200             # per-run times kept with a Timing
GPU_FLUSH_BYTES = 256 << 20   # > 2x the largest L2 on the devices we target (H100 50 MB, H200 50 MB)


def original_functions() -> dict[str, Any]:
    """What the timing code relies on; the worker checks these are unchanged after a candidate ran."""
    return {"time.perf_counter_ns": (time, "perf_counter_ns", _perf_counter_ns),
            "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time", _elapsed_time),
            "torch.cuda.Event.record": (torch.cuda.Event, "record", _record),
            "torch._C._cuda_synchronize": (torch._C, "_cuda_synchronize", _cuda_sync)}


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


def summarize(samples_ms: Sequence[float], clock: str) -> Timing:
    s = sorted(samples_ms)
    if len(s) >= 4:
        q = statistics.quantiles(s, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = s[-1] - s[0]
    return Timing(median_ms=statistics.median(s), iqr_ms=iqr, mean_ms=statistics.fmean(s),
                  min_ms=s[0], max_ms=s[-1], runs=len(s), clock=clock,
                  samples_ms=[float(f"{x:.6g}") for x in samples_ms][:MAX_SAMPLES], host_load=host_load())


def host_load() -> Optional[float]:
    """The 1-minute load average per CPU this process may use: above 1, timed runs shared the CPUs."""
    try:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return round(os.getloadavg()[0] / max(cpus, 1), 3)
    except OSError:
        return None


def time_runs(fn: Callable[..., Any], make_args: Callable[[int], Sequence[Any]], device: str,
              warmup: int = 3, runs: int = 20, flush_l2: bool = True,
              on_output: Optional[Callable[[int, Any], None]] = None) -> Timing:
    """Time ``fn(*make_args(i))`` for ``runs`` runs; each run gets fresh argument buffers.

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
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            for i in range(runs):
                args = tuple(make_args(i))
                flusher()
                device_sync(device)
                _record(start)
                out = fn(*args)
                device_sync(device)
                _record(end)
                _cuda_sync()
                samples.append(_elapsed_time(start, end))
                if on_output is not None:
                    on_output(i, out)
                del args, out
            clock = "cuda_event"
        else:
            for i in range(runs):
                args = tuple(make_args(i))
                flusher()
                t0 = _perf_counter_ns()
                out = fn(*args)
                samples.append((_perf_counter_ns() - t0) / 1e6)
                if on_output is not None:
                    on_output(i, out)
                del args, out
            clock = "perf_counter"
    return summarize(samples, clock)
