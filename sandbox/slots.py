"""What a sandbox may use on this host: CPU cores for builds, GPUs as slots."""
from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets), not the host's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for its workers."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
