"""One timing routine for everything: reference eager, reference torch.compile, candidates.

``time_runs`` times a call with the device's clock (``hardware.clock.time_samples``, whose
docstring gives the policy) and summarises the runs: median and IQR of the per-run times.
"""
from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from typing import Any, Callable, Optional, Sequence

from hardware.clock import time_samples
from sandbox.result import Timing

MAX_SAMPLES = 200             # per-run times kept with a Timing


def summarize(samples_ms: Sequence[float], clock: str, faults: Optional[Sequence[int]] = None) -> Timing:
    s = sorted(samples_ms)
    if len(s) >= 4:
        q = statistics.quantiles(s, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = s[-1] - s[0]
    return Timing(median_ms=statistics.median(s), iqr_ms=iqr, mean_ms=statistics.fmean(s),
                  min_ms=s[0], max_ms=s[-1], runs=len(s), clock=clock,
                  samples_ms=[float(f"{x:.6g}") for x in samples_ms][:MAX_SAMPLES], host_load=host_load(),
                  page_faults=float(statistics.median(faults)) if faults else None)


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
    """Time ``fn(*make_args(i))`` for ``runs`` runs (``hardware.clock.time_samples``) and summarise them
    (on cpu with the median minor page faults per timed call, ``Timing.page_faults``)."""
    faults: Optional[list[int]] = [] if device != "cuda" else None
    alloc0 = allocator_counts(device)
    cpu0, wall0, pre0 = time.thread_time(), time.perf_counter(), _preemptions()
    samples, clock = time_samples(fn, make_args, device, warmup=warmup, runs=runs, flush_l2=flush_l2,
                                  on_output=on_output, faults=faults)
    cpu, wall, pre = time.thread_time() - cpu0, time.perf_counter() - wall0, _preemptions()
    alloc1 = allocator_counts(device)
    t = summarize(samples, clock, faults)
    t.host_cpu_ms, t.host_wall_ms = round(cpu * 1e3, 3), round(wall * 1e3, 3)
    t.host_preempted = pre - pre0 if pre is not None and pre0 is not None else None
    t.host_cpu_mhz, t.gpu_sm_mhz = clocks(device)
    if alloc0 is not None and alloc1 is not None:
        t.device_allocs, t.alloc_retries = alloc1[0] - alloc0[0], alloc1[1] - alloc0[1]
    return t


def allocator_counts(device: str) -> Optional[tuple[int, int]]:
    """cuda: the caching allocator's counts so far of blocks taken from the driver and of retries
    after a failed allocation (``torch.cuda.memory_stats``); None elsewhere or where unknown."""
    if device != "cuda":
        return None
    try:
        import torch

        stats = torch.cuda.memory_stats()
        return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))
    except Exception:  # noqa: BLE001 - no statistics (another allocator backend): not known
        return None


def clocks(device: str) -> tuple[Optional[float], Optional[float]]:
    """The current frequency (MHz) of the core the calling thread last ran on (Linux cpufreq, else
    /proc/cpuinfo), and on cuda the current device's SM clock (NVML through ``torch.cuda.clock_rate``);
    None for what this host cannot tell."""
    cpu_mhz: Optional[float] = None
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
            core = int(f.read().rsplit(")", 1)[1].split()[36])      # field 39, "processor"
        try:
            with open(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq") as f:
                cpu_mhz = round(int(f.read()) / 1e3, 1)
        except OSError:
            with open("/proc/cpuinfo") as f:
                blocks = f.read().split("\n\n")
            for b in blocks:
                fields = dict(line.split(":", 1) for line in b.splitlines() if ":" in line)
                if fields and int(fields.get("processor\t", "-1")) == core and "cpu MHz\t\t" in fields:
                    cpu_mhz = round(float(fields["cpu MHz\t\t"]), 1)
    except (OSError, ValueError, IndexError):
        pass
    sm_mhz: Optional[float] = None
    if device == "cuda":
        try:
            import torch

            sm_mhz = float(torch.cuda.clock_rate())
        except Exception:  # noqa: BLE001 - no NVML (nvidia-ml-py) here: the clock is simply not known
            pass
    return cpu_mhz, sm_mhz


def _preemptions() -> Optional[int]:
    """Involuntary context switches of the calling thread so far (Linux; None elsewhere)."""
    try:
        return int(resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_nivcsw)
    except (OSError, ValueError, AttributeError):
        return None
