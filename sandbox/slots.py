"""What a sandbox may use on this host: CPU cores for builds, GPUs as slots."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets), not the host's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


CORES_PER_BUILD = 4     # a build's translation units at once: the C++ file, the CUDA file (nvcc --threads 2)
MAX_BUILD_JOBS = 8


def build_plan(cores: int, build_slots: int | None = None) -> tuple[int, int]:
    """Builds at once and ninja jobs per build on ``cores`` (``build_slots``: the builds at once, as
    asked). A build compiles two translation units, nvcc's with two threads: about four cores each,
    so one build per four cores (at least one), its jobs the cores it has (2 to 8). Warm build
    workers are kept one per build slot (``Sandbox``)."""
    slots = max(1, build_slots or cores // CORES_PER_BUILD)
    return slots, max(2, min(MAX_BUILD_JOBS, cores // slots))


CPU_THREADS_ENV = "KERNELLOOP_CPU_THREADS"


def cpu_timing_threads() -> int:
    """Intra-op threads of every reference and candidate worker on the ``cpu`` target (both timed
    with the same count). One by default: with torch's default (one per core) on a small host, a
    worker's threads wait on whatever else runs (another worker, a build), and a 0.12 ms forward was
    timed at medians of 5-24 ms on 2 cores; with one thread it stayed at 0.13-0.17 ms."""
    return _count_setting(CPU_THREADS_ENV, 1, "thread")


def _count_setting(name: str, default: int, unit: str) -> int:
    """A whole number of at least 1 from the environment variable ``name`` (``default`` where unset);
    anything else is an error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: give a whole number of {unit}s (default {default})") from None
    if n < 1:
        raise ValueError(f"{name}={raw!r}: give at least 1 {unit}")
    return n


CPU_BLOCKS_ENV = "KERNELLOOP_CPU_BLOCKS"
DEFAULT_CPU_BLOCKS = 4


def cpu_timing_blocks() -> int:
    """Blocks the timed runs of an evaluation are split into on the ``cpu`` target
    (``sandbox.checks``: the candidate's and the reference's blocks interleaved, ABBA). 4 by
    default (20 timed runs: 4 blocks of 5): an even count, so each side goes first in as many
    blocks as it goes second and a drift that is linear over two blocks cancels exactly; 1 gives
    the old sequence, each side's runs in one block."""
    return _count_setting(CPU_BLOCKS_ENV, DEFAULT_CPU_BLOCKS, "block")


def cpu_timing_note(what: str = "reference and candidate", tail: str = "", blocks: bool = True) -> str:
    """The ``cpu`` timing convention, as commands print it beside their figures (``blocks``: the
    sandbox's interleaved blocks apply; ``kernelloop baseline`` times in one block of its own)."""
    b = cpu_timing_blocks() if blocks else 1
    how = (f", their timed runs in {b} interleaved blocks, ABBA ({CPU_BLOCKS_ENV})" if b > 1 else "")
    return f"timing on cpu: {what} with {cpu_timing_threads()} intra-op thread(s) each ({CPU_THREADS_ENV}){how}{tail}"


@contextlib.contextmanager
def cpu_timing_threads_here() -> Iterator[int]:
    """This process's intra-op threads set to the workers' count while it times on ``cpu``
    (``kernelloop baseline`` times in its own process), then put back."""
    n, before = cpu_timing_threads(), torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def cpu_thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a worker ``threads`` intra-op threads (torch's pool reads these
    before it starts: set at spawn, not after)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for its workers."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


# Build workers (and the compilers they start) run this much nicer than the timed workers: a timed
# run's host thread that waits behind a compiler for a time slice leaves the GPU idle between the
# clock's start event and the forward's kernels (session v: reference windows with runs 2-5x slow
# for 30-100 ms, 16 compilers on a lane's 16 cores). At nice 10 a compiler weighs about a tenth of
# a nice-0 thread, and takes the whole of any core left idle. ``KERNELLOOP_BUILD_NICE`` sets it (0: off).
BUILD_NICE = 10


def build_nice() -> int:
    raw = os.environ.get("KERNELLOOP_BUILD_NICE", str(BUILD_NICE))
    try:
        return max(0, min(19, int(raw)))
    except ValueError:
        raise ValueError(f"KERNELLOOP_BUILD_NICE must be an integer 0-19, not {raw!r}") from None


# A task's candidates stay on the GPU where its reference already runs until that GPU has this many
# more candidates in flight than the least-loaded one. Each GPU starts its own reference worker per
# task (its model and warm-up torch.compile: 10-19 s at KernelBench's level-2 sizes, holding back
# that GPU's timings meanwhile), while a candidate holds a GPU for about a second: on four H200s
# the least-loaded rule started every task's reference on every GPU (reference 15 s median on
# GPUs 1-3 of the level-2 mix), and four GPUs gave 2.5x one.
REFERENCE_AFFINITY = 4


def slot_preference(load: int, has_reference: bool) -> tuple[int, bool]:
    """The key a slot is chosen by, least first (the local sandbox's GPUs and the Ray executor's
    slots): its candidates in flight, ``REFERENCE_AFFINITY`` fewer where the task's reference
    runs there; among equals, one with the reference."""
    return load - (REFERENCE_AFFINITY if has_reference else 0), not has_reference
