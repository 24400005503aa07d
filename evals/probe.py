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

Both use ``sandbox.timing.time_runs``, the routine every other timing uses. The best run
(not the median) is kept because these are ceilings: a higher ceiling gives a lower, never
an unfairly high, roofline floor.

Results are cached per (device name, torch version) in the store's ``device_probes``
table and in ``<cache_dir>/device_probes.json``, so commands without a store still find them.
"""
from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer

from kernelloop.cli_common import DbOption, DeviceOption, console, fail, open_store, resolve_device
from sandbox.harness import cpu_model

PROBE_FILE = "device_probes.json"

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Measure and show the device's bandwidth and FLOP ceilings.")


@app.callback()
def _group(db: Optional[str] = DbOption) -> None:
    """``--db`` here holds for every device subcommand."""



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


def measure_bandwidth(device: str, nbytes: int, runs: int = 10, warmup: int = 3) -> dict[str, float]:
    """GB/s of a device-to-device copy of ``nbytes`` (read + written) and of a read-only pass
    (a sum over ``nbytes``); reductions can stream a little faster than copies."""
    import torch

    from sandbox.timing import time_runs

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = time_runs(lambda d, s: d.copy_(s), lambda i: (dst, src), device,
                     warmup=warmup, runs=runs, flush_l2=False)
    del dst
    # Two read patterns: a full reduction, and row sums over a (planes, rows, 4096) view (one
    # output per plane and column); which streams fastest depends on the device.
    planes = max(1, src.numel() // (256 * 4096))
    view = src[: planes * 256 * 4096].view(planes, 256, 4096)
    reads = [time_runs(torch.sum, lambda i: (src,), device, warmup=warmup, runs=runs, flush_l2=False),
             time_runs(lambda v: v.sum(dim=1), lambda i: (view,), device, warmup=warmup, runs=runs, flush_l2=False)]
    read_bytes = [nbytes, view.numel() * 4]
    del src, view
    return {"copy_gbps": 2 * nbytes / (copy.min_ms / 1e3) / 1e9,
            "read_gbps": max(b / (t.min_ms / 1e3) / 1e9 for b, t in zip(read_bytes, reads))}


def measure_matmul(device: str, dtype_label: str, n: int, runs: int = 10, warmup: int = 3) -> float:
    """TFLOP/s of an ``n x n`` matmul in ``dtype_label`` (fp32 | tf32 | fp16 | bf16)."""
    import torch

    from sandbox.timing import time_runs

    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
             "bf16": torch.bfloat16}[dtype_label]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype_label == "tf32"
    try:
        timing = time_runs(lambda x, y: torch.matmul(x, y, out=out), lambda i: (a, b), device,
                           warmup=warmup, runs=runs, flush_l2=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * n ** 3 / (timing.min_ms / 1e3) / 1e12


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

def _cache_file() -> Path:
    from kernelloop.paths import cache_dir

    return cache_dir() / PROBE_FILE


def _read_cache_file() -> dict[str, Any]:
    path = _cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache_file(probe: Probe) -> None:
    path = _cache_file()
    data = _read_cache_file()
    data[probe.key] = probe.to_dict()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def _from_row(row: Any) -> Probe:
    return Probe(device=row.device, device_name=row.device_name, torch_version=row.torch_version,
                 bandwidth_gbps=float(row.bandwidth_gbps), tflops={k: float(v) for k, v in row.flops.items()},
                 created_at=row.created_at.isoformat(timespec="seconds") if row.created_at else None)


def load_cached(device: str, store: Any = None, name: Optional[str] = None,
                version: Optional[str] = None) -> Optional[Probe]:
    """The latest cached probe for this device name and torch version (store first, then file)."""
    name = name or device_name(device)
    version = version or torch_version()
    if store is not None:
        import sqlalchemy as sa

        from store.models import DeviceProbe

        with store.reader() as session:
            row = session.scalar(
                sa.select(DeviceProbe)
                .where(DeviceProbe.device_name == name, DeviceProbe.torch_version == version)
                .order_by(DeviceProbe.id.desc()).limit(1))
            if row is not None:
                probe = _from_row(row)
                if f"{name}|{version}" not in _read_cache_file():
                    # The sandbox reads the file (it has no store): a run on a fresh machine with
                    # a carried store otherwise evaluated with no floor at all.
                    _write_cache_file(probe)
                return probe
    entry = _read_cache_file().get(f"{name}|{version}")
    if entry:
        probe = Probe.from_dict(entry)
        if store is not None:
            save(probe, store, write_file=False)
        return probe
    return None


def save(probe: Probe, store: Any = None, write_file: bool = True) -> None:
    if write_file:
        _write_cache_file(probe)
    if store is not None:
        from store.models import DeviceProbe

        with store.session() as session:
            session.add(DeviceProbe(device=probe.device, device_name=probe.device_name,
                                    torch_version=probe.torch_version,
                                    bandwidth_gbps=probe.bandwidth_gbps, flops=dict(probe.tflops)))


def get_probe(device: str, store: Any = None, measure: bool = True, refresh: bool = False) -> Optional[Probe]:
    """The device's ceilings: cached ones when there are any (unless ``refresh``), else
    measured now and cached (``measure=False``: ``None`` instead of measuring)."""
    if not refresh:
        cached = load_cached(device, store)
        if cached is not None:
            return cached
    if not measure:
        return None
    probe = measure_probe(device)
    save(probe, store)
    return probe


# --------------------------------------------------------------------------- commands

def _print_probe(probe: Probe, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("ceiling")
    table.add_column("value", justify="right")
    table.add_row("device", f"{probe.device}: {probe.device_name}")
    table.add_row("torch", probe.torch_version)
    table.add_row("bandwidth", f"{probe.bandwidth_gbps:,.1f} GB/s")
    for label, rate in sorted(probe.tflops.items()):
        table.add_row(f"matmul {label}", f"{rate:,.2f} TFLOP/s")
    if probe.created_at:
        table.add_row("measured", probe.created_at)
    console.print(table)


@app.command("probe")
def probe_command(device: Optional[str] = DeviceOption, db: Optional[str] = DbOption) -> None:
    """Measure bandwidth and matmul FLOP rates now and cache them (store and cache file)."""
    dev = resolve_device(device)
    store = open_store(db)
    try:
        probe = get_probe(dev, store, measure=True, refresh=True)
    finally:
        store.close()
    _print_probe(probe, "device probe (measured now)")
    console.print(f"cached in the store and in {_cache_file()}")


@app.command("show")
def show_command(device: Optional[str] = DeviceOption, db: Optional[str] = DbOption,
                 all_: bool = typer.Option(False, "--all", help="list every probe in the store")) -> None:
    """Show the cached ceilings of this device (and torch version); nothing is measured."""
    dev = resolve_device(device)
    store = open_store(db)
    try:
        if all_:
            _show_all(store)
            return
        probe = load_cached(dev, store)
    finally:
        store.close()
    if probe is None:
        fail(f"no probe cached for {device_name(dev)} with torch {torch_version()}; "
             f"run: kernelloop device probe --device {dev}", code=1)
    _print_probe(probe, "device probe (cached)")


def _show_all(store: Any) -> None:
    import sqlalchemy as sa
    from rich.table import Table

    from store.models import DeviceProbe

    with store.reader() as session:
        rows = list(session.scalars(sa.select(DeviceProbe).order_by(DeviceProbe.id)))
    table = Table(title="device probes in the store")
    for col in ("id", "device", "device name", "torch", "GB/s", "TFLOP/s", "measured"):
        table.add_column(col)
    for r in rows:
        rates = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.flops.items()))
        table.add_row(str(r.id), r.device, r.device_name, r.torch_version, f"{r.bandwidth_gbps:,.1f}", rates,
                      r.created_at.isoformat(timespec="seconds") if r.created_at else "")
    console.print(table)
