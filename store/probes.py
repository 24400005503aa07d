"""Device probes in the store (``device_probes``), kept in step with the cache file of ``hardware.probe``.

Commands with a store read and write probes here; the sandbox, which has no store, reads the
cache file, so a probe only the store holds is written to the file when it is read.
"""
from __future__ import annotations

from typing import Any, Optional

import sqlalchemy as sa

from hardware import probe as hw
from hardware.probe import Probe
from store.models import DeviceProbe


def _from_row(row: Any) -> Probe:
    return Probe(device=row.device, device_name=row.device_name, torch_version=row.torch_version,
                 bandwidth_gbps=float(row.bandwidth_gbps), tflops={k: float(v) for k, v in row.flops.items()},
                 created_at=row.created_at.isoformat(timespec="seconds") if row.created_at else None)


def load_cached(device: str, store: Any = None, name: Optional[str] = None,
                version: Optional[str] = None) -> Optional[Probe]:
    """The latest cached probe for this device name and torch version (store first, then file)."""
    name = name or hw.device_name(device)
    version = version or hw.torch_version()
    if store is not None:
        with store.reader() as session:
            row = session.scalar(
                sa.select(DeviceProbe)
                .where(DeviceProbe.device_name == name, DeviceProbe.torch_version == version)
                .order_by(DeviceProbe.id.desc()).limit(1))
            if row is not None:
                probe = _from_row(row)
                if f"{name}|{version}" not in hw.read_cache_file():
                    # The sandbox reads the file (it has no store): a run on a fresh machine with
                    # a carried store otherwise evaluated with no floor at all.
                    hw.write_cache_file(probe)
                return probe
    entry = hw.read_cache_file().get(f"{name}|{version}")
    if entry:
        probe = Probe.from_dict(entry)
        if store is not None:
            save(probe, store, write_file=False)
        return probe
    return None


def save(probe: Probe, store: Any = None, write_file: bool = True) -> None:
    if write_file:
        hw.write_cache_file(probe)
    if store is not None:
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
    probe = hw.measure_probe(device)
    save(probe, store)
    return probe


def all_probes(store: Any) -> list[Probe]:
    """Every probe in the store, oldest first."""
    with store.reader() as session:
        return [_from_row(r) for r in session.scalars(sa.select(DeviceProbe).order_by(DeviceProbe.id))]
