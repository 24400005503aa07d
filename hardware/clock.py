"""The device's clock: how one call is timed on cuda (events) and cpu (a monotonic clock).

``time_samples`` is the one timing loop every figure comes from (reference eager, reference
torch.compile, candidates, the device probe); ``sandbox.timing.time_runs`` summarises its
samples into a ``Timing``.

Policy (GPU): warm-up runs, then for each timed run: fresh input buffers (made before the
clock starts), the L2 cache flushed by writing a buffer larger than it, a CUDA event
recorded, the call, a *device-wide* synchronize (so work left on side streams is
counted), a second event. CPU: the same policy with a monotonic clock and a buffer larger
than the last-level cache.

The clock and synchronize functions are bound when this module is imported (before any
candidate code runs in a worker), so a candidate that later patches ``time`` or
``torch.cuda`` does not change what this module calls.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

_perf_counter_ns = time.perf_counter_ns
_cuda_sync = getattr(torch._C, "_cuda_synchronize", None)
_Event = torch.cuda.Event
_elapsed_time = torch.cuda.Event.elapsed_time
_record = torch.cuda.Event.record

CPU_FLUSH_BYTES = 64 << 20
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


def time_samples(fn: Callable[..., Any], make_args: Callable[[int], Sequence[Any]], device: str,
                 warmup: int = 3, runs: int = 20, flush_l2: bool = True,
                 on_output: Optional[Callable[[int, Any], None]] = None) -> tuple[list[float], str]:
    """Milliseconds of ``fn(*make_args(i))`` for each of ``runs`` runs, and the clock's name.

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
            return samples, "cuda_event"
        for i in range(runs):
            args = tuple(make_args(i))
            flusher()
            t0 = _perf_counter_ns()
            out = fn(*args)
            samples.append((_perf_counter_ns() - t0) / 1e6)
            if on_output is not None:
                on_output(i, out)
            del args, out
    return samples, "perf_counter"
