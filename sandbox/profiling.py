"""Profiler evidence: which kernels (GPU) or operators (CPU) a forward launches.

On ``cuda`` the rows are device kernels with their device time; on ``cpu`` they are the
top-level operators (``aten::*``) and calls into the candidate's own extension functions
(``kernelloop_ext::*``, recorded by the build hook's proxy) with their self CPU time.
A row is ``own`` when it is a kernel the candidate's CUDA source declares, or a call
into its extension.

On ``cuda`` every profiled run is preceded by the clock's preamble (``hardware.clock.preamble``):
the forward's work that started before the preamble's end started before the clock's start event,
off the clock (``ahead_of_clock``); the judge flags it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile


def _is_own(name: str, own_kernels: Sequence[str]) -> bool:
    if name.startswith("kernelloop_ext::"):
        return True
    return any(name == k or name.startswith(k + "(") or name.startswith(k + "<") or f" {k}(" in name
               or f"::{k}(" in name or f"{k}<" in name for k in own_kernels)


def warm_up(device: str, kernels: bool = True) -> None:
    """Open and close one profiler session on a tiny op (``kernels`` False: on none). A process's
    first CUDA profiler session initialises CUPTI; on an H200 host every candidate's profile took
    3.5-4 s, most of it that, and the parent holds the device while a candidate is profiled.
    Workers call this while they load, before the device is theirs. On ``cpu`` the first session
    costs seconds too (measured 2.9 s of a 4 s hold on a 2-core machine). Best effort: the real
    profile reports any failure."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=activities):
            if kernels:
                torch.zeros(1, device=device).add_(1)
                if device == "cuda":
                    torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


AHEAD_TOLERANCE_US = 1.0              # timestamps of two streams compared: below this, no evidence


def _device_events(events: Sequence[Any]) -> list[Any]:
    """Device-side activity (kernels, copies, memsets); ranges of ``record_function`` (a candidate's) also show as
    device-side annotations, which are not work and would count a candidate's time twice."""
    return [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.name
            and not e.name.startswith(("kernelloop_ext::", "kernelloop::")) and not getattr(e, "is_user_annotation", False)]


def split_preamble(events: Sequence[Any]) -> tuple[list[tuple[float, float]], list[Any]]:
    """The GPU span (start, end, microseconds) of each run's preamble and the device events that
    are not the preamble's, read from the device timeline alone (on an H100 the profiler linked
    neither the flush nor the spin to the range that launched them).

    The preamble runs on the caller's stream: its stream is that of the profile's first device
    event (the first run's flush, launched after a device-wide synchronize and before any of the
    candidate's code in the profile). Each run's preamble is a ``spin_kernel`` on that stream and
    the event just before it there (the flush). A forward's own kernels on that stream queue
    behind the spin, so nothing of the candidate's is taken for the preamble but what ran on the
    caller's stream after the spin, which is no evidence either way."""
    device = sorted(_device_events(events), key=lambda e: e.time_range.start)
    if not device:
        return [], []
    stream = getattr(device[0], "device_resource_id", None)
    on_stream = [e for e in device if getattr(e, "device_resource_id", None) == stream]
    spans: list[tuple[float, float]] = []
    preamble_ids: set[int] = set()
    for i, e in enumerate(on_stream):
        if "spin_kernel" not in e.name:
            continue
        begin = e.time_range.start
        before = on_stream[i - 1] if i > 0 else None
        if before is not None and id(before) not in preamble_ids and (not spans or before.time_range.start >= spans[-1][1]):
            begin = before.time_range.start
            preamble_ids.add(id(before))
        preamble_ids.add(id(e))
        spans.append((begin, e.time_range.end))
    return spans, [e for e in device if id(e) not in preamble_ids]


def ahead_of_clock(spans: Sequence[tuple[float, float]], work: Sequence[Any]) -> list[dict[str, Any]]:
    """The forward's device work that started while a preamble still ran: before the end of its
    last kernel (the spin), so before the point where the clock records its start event. The
    device was idle when each preamble began (a device-wide synchronize) and all of a forward's
    work is launched after its preamble, so anything starting inside a preamble's span is that
    run's forward, on a stream that did not wait for the caller's."""
    found = []
    for e in work:
        start = e.time_range.start
        for a, b in spans:
            if a <= start < b - AHEAD_TOLERANCE_US:
                found.append({"name": e.name, "stream": int(getattr(e, "device_resource_id", -1)),
                              "early_us": round(b - start, 1)})
                break
    found.sort(key=lambda r: -r["early_us"])
    return found


# The input sets a profile holds at once: one per run while they are small (each run reads inputs
# of its own), one for every run past this many bytes together, as the timing holds at most one
# set alive (``hardware.clock.time_samples``). A task with gigabytes of inputs is then profiled in
# the memory its evaluation was admitted with (``sandbox.admission`` counts one set): three 8 GiB
# sets at once put the reference of KernelBench's 38_L1Norm_ 16 GiB past it on an 80 GB H100.
PROFILE_SETS_BYTES = 1 << 30


def input_sets(make_args: Callable[[int], Sequence[Any]], runs: int) -> list[tuple[Any, ...]]:
    """The argument set of each of ``runs`` profiled runs (distinct sets only while they fit
    ``PROFILE_SETS_BYTES`` together)."""
    from sandbox.footprint import _tensor_bytes      # the measure the footprint's inputs_bytes is

    first = tuple(make_args(10_000))
    size = _tensor_bytes(first)
    distinct = runs if size * runs <= PROFILE_SETS_BYTES else 1
    sets = [first] + [tuple(make_args(10_000 + i)) for i in range(1, distinct)]
    return [sets[i % distinct] for i in range(runs)]


def profile_forward(model: Callable, make_args: Callable[[int], Sequence[Any]], device: str,
                    runs: int = 3, own_kernels: Sequence[str] = ()) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The forward's profile rows, and (cuda) whether any of its work ran ahead of the clock:
    each profiled run is preceded by the clock's own preamble (``hardware.clock.preamble``)."""
    from hardware import clock

    arg_sets = input_sets(make_args, runs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    ahead: dict[str, Any] = {}
    with torch.no_grad():
        model(*arg_sets[0])      # warm
        flusher = None
        if device == "cuda":
            flusher = clock.L2Flusher(device)
            clock.preamble(flusher)      # outside the profile: the spin measures its clock rate on first use
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for args in arg_sets:
                if flusher is not None:
                    clock.preamble(flusher)
                model(*args)
            if device == "cuda":
                torch.cuda.synchronize()
        del flusher
    totals: dict[str, list[float]] = {}
    if device == "cuda":
        spans, work = split_preamble(prof.events())
        ahead = {"runs_checked": len(spans), "runs": runs, "work": ahead_of_clock(spans, work)[:10],
                 "tampered": clock.tampered_functions()}
        for evt in work:
            dur = evt.time_range.end - evt.time_range.start
            entry = totals.setdefault(evt.name, [0, 0.0])
            entry[0] += 1
            entry[1] += dur
    else:
        for evt in prof.key_averages():
            name = evt.key
            if not (name.startswith("aten::") or name.startswith("kernelloop_ext::")):
                continue
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += evt.count
            entry[1] += evt.self_cpu_time_total
    grand = sum(v[1] for v in totals.values()) or 1.0
    rows = [{"name": name, "count": int(round(c / runs)) or 1, "total_us": t / runs, "share": t / grand,
             "own": _is_own(name, own_kernels)} for name, (c, t) in totals.items()]
    rows.sort(key=lambda r: -r["total_us"])
    return rows[:40], ahead
