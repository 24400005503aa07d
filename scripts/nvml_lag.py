"""How NVML's per-process SM samples line up with the host's clock (GPU host; ``sandbox.quiet``).

The judge reads NVML's SM samples over each timing window and flags another process's use as
``contended``. Session ag's H100 run suggested NVML stamps its samples ahead of the host's clock
(samples read within milliseconds of a window's start stamped 245-1,018 ms after it), so that the
work just before a window was judged the window's. This measures it: a child process runs bursts
of kernels and prints, on the host's clock, when each burst began and ended; the parent reads the
child's SM samples (``nvmlDeviceGetProcessUtilization``) and prints, per burst, the first and last
stamp showing use against the burst's start and end, and the offset of NVML's newest stamp from
``time.time()`` read back to back (``sandbox.quiet.latest_stamp``).

    source scripts/gpu_env.sh && python3 scripts/nvml_lag.py --bursts 6 --burst-ms 300 --gap-ms 4000
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHILD = r"""
import json, sys, time, torch
bursts, burst_ms, gap_ms = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
x = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
time.sleep(gap_ms / 1000)
for _ in range(bursts):
    t0 = time.time()
    while (time.time() - t0) * 1000 < burst_ms:
        for _ in range(8):
            x = torch.tanh(x @ x * 1e-4)
        torch.cuda.synchronize()
    print(json.dumps({"start_us": int(t0 * 1e6), "end_us": int(time.time() * 1e6)}), flush=True)
    time.sleep(gap_ms / 1000)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--burst-ms", type=float, default=300.0)
    ap.add_argument("--gap-ms", type=float, default=4000.0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    import pynvml

    from sandbox.quiet import latest_stamp, sample_period_us

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
    period = sample_period_us(pynvml, handle, str(args.gpu))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(args.bursts), str(args.burst_ms), str(args.gap_ms)],
                             stdout=subprocess.PIPE, text=True)
    offsets, samples, seen = [], {}, int(time.time() * 1e6)
    while child.poll() is None:
        host = int(time.time() * 1e6)
        newest = latest_stamp(pynvml, handle)
        if newest is not None:
            offsets.append((newest - host) / 1000)
        try:
            for s in pynvml.nvmlDeviceGetProcessUtilization(handle, seen):
                if s.pid == child.pid:
                    samples[int(s.timeStamp)] = int(s.smUtil)
        except pynvml.NVMLError:
            pass
        time.sleep(0.02)
    bursts = [json.loads(line) for line in child.stdout.read().splitlines() if line.startswith("{")]
    rows = []
    for i, b in enumerate(bursts):
        # a burst's busy samples: those stamped nearer to it than to its neighbours (session ah's first
        # run took a fixed span wider than the gap, and read the neighbours' samples as this burst's)
        lo = (bursts[i - 1]["end_us"] + b["start_us"]) // 2 if i else b["start_us"] - args.gap_ms * 500
        hi = (b["end_us"] + bursts[i + 1]["start_us"]) // 2 if i + 1 < len(bursts) else b["end_us"] + args.gap_ms * 500
        busy = sorted(t for t, u in samples.items() if u > 0 and lo <= t < hi)
        rows.append({"first_after_start_ms": (busy[0] - b["start_us"]) / 1000 if busy else None,
                     "last_after_end_ms": (busy[-1] - b["end_us"]) / 1000 if busy else None})
    out = {"sample_period_ms": period / 1000, "bursts": rows,
           "nvml_newest_minus_host_ms": {"median": statistics.median(offsets), "min": min(offsets), "max": max(offsets)}
           if offsets else None}
    print(f"sample period {period / 1000:.0f} ms")
    for i, r in enumerate(rows):
        print(f"burst {i}: first busy sample {r['first_after_start_ms']} ms after its start, "
              f"last {r['last_after_end_ms']} ms after its end (host clock)")
    if offsets:
        o = out["nvml_newest_minus_host_ms"]
        print(f"NVML's newest stamp minus the host's clock: median {o['median']:.0f} ms (min {o['min']:.0f}, max {o['max']:.0f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
