"""Which sandbox worker holds how much GPU memory: samples NVML's per-process use every
INTERVAL seconds until interrupted (SIGINT/SIGTERM), then prints each process's peak with its
role (read from its working directory, /tmp/kl-<role>-*: reference, candidate, warm, build),
and the largest total seen. A check of the admission's figures against what workers really take.

    python3 scripts/gpu_memwatch.py [--interval 0.2] [--gpu 0] > memwatch.txt &
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import time


def role_of(pid: int) -> str:
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "?"
    found = re.search(r"/kl-([a-z]+)-", cwd)
    return found.group(1) if found else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--gpu", type=int, default=0)
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
    peaks: dict[int, tuple[int, str]] = {}
    roles: dict[int, str] = {}
    total_peak, total_at = 0, ""
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    t0 = time.monotonic()
    while not stop:
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError:
            procs = []
        now = {p.pid: int(p.usedGpuMemory or 0) for p in procs}
        for pid, used in now.items():
            if pid not in roles or roles[pid] == "?":
                roles[pid] = role_of(pid)       # read while the process lives: it may be gone at its peak
            if used > peaks.get(pid, (0, ""))[0]:
                peaks[pid] = (used, roles[pid])
        if sum(now.values()) > total_peak:
            total_peak = sum(now.values())
            total_at = ", ".join(f"{peaks[p][1]} {p}: {u / 2**30:.2f} GiB" for p, u in sorted(now.items()))
        time.sleep(args.interval)
    print(f"sampled {time.monotonic() - t0:.0f} s; largest total {total_peak / 2**30:.2f} GiB ({total_at})")
    by_role: dict[str, list[int]] = {}
    for pid, (used, role) in sorted(peaks.items()):
        by_role.setdefault(role, []).append(used)
    for role, used in sorted(by_role.items()):
        print(f"{role}: {len(used)} process(es), peak {max(used) / 2**30:.2f} GiB, "
              f"median peak {sorted(used)[len(used) // 2] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
