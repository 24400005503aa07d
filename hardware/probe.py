"""Device ceilings: memory bandwidth and matmul FLOP rates, measured once and cached.

``kernelloop device probe`` measures:

* **bandwidth**: a large device-to-device copy (``dst.copy_(src)``), bytes read plus bytes
  written over the time of the best run, in GB/s (1e9 bytes); and a read-only pass over the
  same buffer (a full ``sum`` and per-plane row sums), which can stream slightly faster. The
  highest of these is kept. Measured ceilings are estimates: a kernel with a luckier access
  pattern can come within a few percent of, or just past, the floor they give, so a check
  for "faster than possible" should allow a margin.
* **FLOP rates**: square matmuls per dtype, ``2 n^3`` FLOPs over the best run, in TFLOP/s:
  ``fp32`` (TF32 off), ``tf32`` (TF32 on), ``fp16`` and ``bf16`` on cuda; ``fp32`` on cpu.

Both use ``hardware.clock.time_samples``, the loop every other timing uses. The best run
(not the median) is kept because these are ceilings: a higher ceiling gives a lower, never
an unfairly high, roofline floor.

Results are cached per (device name, torch version) in ``<cache_dir>/device_probes.json``
(what the sandbox reads: it has no store) and in the store's ``device_probes`` table
(``store.probes``, for commands with a store). ``kernelloop device`` (``evals.device_cli``)
measures and shows them.
"""
from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

PROBE_FILE = "device_probes.json"


@dataclass
class Probe:
    device: str                         # cuda | cpu
    device_name: str
    torch_version: str
    bandwidth_gbps: float
    tflops: dict[str, float] = field(default_factory=dict)   # dtype name -> TFLOP/s
    created_at: Optional[str] = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.device_name}|{self.torch_version}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Probe":
        return cls(device=data["device"], device_name=data["device_name"],
                   torch_version=data["torch_version"], bandwidth_gbps=float(data["bandwidth_gbps"]),
                   tflops={k: float(v) for k, v in (data.get("tflops") or {}).items()},
                   created_at=data.get("created_at"), details=dict(data.get("details") or {}))


# --------------------------------------------------------------------------- identity


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), what a ``cpu`` evaluation's device is called."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def device_name(device: str) -> str:
    """What the ceilings belong to: the GPU's name, or the CPU model and torch's thread count."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def torch_version() -> str:
    import torch

    return torch.__version__


# --------------------------------------------------------------------------- measuring

def _sizes(device: str) -> dict[str, Any]:
    """Copy size, matmul sizes (the best rate over them is kept) and run counts per device."""
    if device == "cuda":
        return {"copy_bytes": 2 << 30, "matmul_n": [8192], "runs": 10, "warmup": 3}
    # On cpu a matmul that fits in cache runs fastest; both sizes take well under a second.
    return {"copy_bytes": 128 << 20, "matmul_n": [512, 1024], "runs": 8, "warmup": 2}


def _best_ms(fn: Any, args: tuple, device: str, warmup: int, runs: int) -> float:
    """The best of ``runs`` timed calls (no L2 flush: the buffers are far larger than any cache)."""
    from hardware.clock import time_samples

    samples, _ = time_samples(fn, lambda i: args, device, warmup=warmup, runs=runs, flush_l2=False)
    return min(samples)


def measure_bandwidth(device: str, nbytes: int, runs: int = 10, warmup: int = 3) -> dict[str, float]:
    """GB/s of a device-to-device copy of ``nbytes`` (read + written) and of a read-only pass
    (a sum over ``nbytes``); reductions can stream a little faster than copies."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = _best_ms(lambda d, s: d.copy_(s), (dst, src), device, warmup, runs)
    del dst
    # Two read patterns: a full reduction, and row sums over a (planes, rows, 4096) view (one
    # output per plane and column); which streams fastest depends on the device.
    planes = max(1, src.numel() // (256 * 4096))
    view = src[: planes * 256 * 4096].view(planes, 256, 4096)
    reads = [_best_ms(torch.sum, (src,), device, warmup, runs),
             _best_ms(lambda v: v.sum(dim=1), (view,), device, warmup, runs)]
    read_bytes = [nbytes, view.numel() * 4]
    del src, view
    return {"copy_gbps": 2 * nbytes / (copy / 1e3) / 1e9,
            "read_gbps": max(b / (t / 1e3) / 1e9 for b, t in zip(read_bytes, reads))}


def measure_matmul(device: str, dtype_label: str, n: int, runs: int = 10, warmup: int = 3) -> float:
    """TFLOP/s of an ``n x n`` matmul in ``dtype_label`` (fp32 | tf32 | fp16 | bf16)."""
    import torch

    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
             "bf16": torch.bfloat16}[dtype_label]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_label == "tf32"
    try:
        best = _best_ms(lambda x, y: torch.matmul(x, y, out=out), (a, b), device, warmup, runs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * n ** 3 / (best / 1e3) / 1e12


def measure_probe(device: str) -> Probe:
    """Measure the device now (a few seconds on cuda; well under 10 s on cpu)."""
    sizes = _sizes(device)
    bw = measure_bandwidth(device, sizes["copy_bytes"], sizes["runs"], sizes["warmup"])
    labels = ["fp32", "tf32", "fp16", "bf16"] if device == "cuda" else ["fp32"]
    tflops = {label: max(measure_matmul(device, label, n, sizes["runs"], sizes["warmup"])
                         for n in sizes["matmul_n"])
              for label in labels}
    return Probe(device=device, device_name=device_name(device), torch_version=torch_version(),
                 bandwidth_gbps=max(bw.values()), tflops=tflops,
                 created_at=dt.datetime.now(dt.timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds"),
                 details={**bw, "copy_bytes": sizes["copy_bytes"], "matmul_n": sizes["matmul_n"],
                          "runs": sizes["runs"], "statistic": "best run"})


# --------------------------------------------------------------------------- caching


def cache_file() -> Path:
    from kernelloop.paths import cache_dir

    return cache_dir() / PROBE_FILE


def read_cache_file() -> dict[str, Any]:
    """Every probe in the cache file, by ``Probe.key``."""
    path = cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache_file(probe: Probe) -> None:
    path = cache_file()
    data = read_cache_file()
    data[probe.key] = probe.to_dict()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def load_cached(device: str, name: Optional[str] = None, version: Optional[str] = None) -> Optional[Probe]:
    """The cache file's probe for this device name and torch version (``store.probes`` reads the store too)."""
    entry = read_cache_file().get(f"{name or device_name(device)}|{version or torch_version()}")
    return Probe.from_dict(entry) if entry else None


def get_probe(device: str, measure: bool = True, refresh: bool = False) -> Optional[Probe]:
    """The device's ceilings from the cache file (unless ``refresh``), else measured now and
    written there (``measure=False``: ``None`` instead of measuring)."""
    if not refresh:
        cached = load_cached(device)
        if cached is not None:
            return cached
    if not measure:
        return None
    probe = measure_probe(device)
    write_cache_file(probe)
    return probe
