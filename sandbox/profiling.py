"""Profiler evidence: which kernels (GPU) or operators (CPU) a forward launches.

On ``cuda`` the rows are device kernels with their device time; on ``cpu`` they are the
top-level operators (``aten::*``) and calls into the candidate's own extension functions
(``kernelloop_ext::*``, recorded by the build hook's proxy) with their self CPU time.
A row is ``own`` when it is a kernel the candidate's CUDA source declares, or a call
into its extension.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile


def _is_own(name: str, own_kernels: Sequence[str]) -> bool:
    if name.startswith("kernelloop_ext::"):
        return True
    return any(name == k or name.startswith(k + "(") or name.startswith(k + "<") or f" {k}(" in name
               or f"::{k}(" in name or f"{k}<" in name for k in own_kernels)


def warm_up(device: str) -> None:
    """Open and close one profiler session on a tiny op. A process's first CUDA profiler session
    initialises CUPTI; on an H200 host every candidate's profile took 3.5-4 s, most of it that,
    and the parent holds the device while a candidate is profiled. Workers call this while they
    load, before the device is theirs. On ``cpu`` the first session costs seconds too (measured
    2.9 s of a 4 s hold on a 2-core machine). Best effort: the real profile reports any failure."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=activities):
            torch.zeros(1, device=device).add_(1)
            if device == "cuda":
                torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def profile_forward(model: Callable, make_args: Callable[[int], Sequence[Any]], device: str,
                    runs: int = 3, own_kernels: Sequence[str] = ()) -> list[dict[str, Any]]:
    arg_sets = [tuple(make_args(10_000 + i)) for i in range(runs)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad():
        model(*arg_sets[0])      # warm
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for args in arg_sets:
                model(*args)
            if device == "cuda":
                torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    if device == "cuda":
        for evt in prof.events():
            # record_function ranges (kernelloop_ext::*) also appear as device-side annotations; they
            # are not kernels and would count the candidate's time twice.
            if (getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and evt.name
                    and not evt.name.startswith("kernelloop_ext::")):
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
    return rows[:40]
