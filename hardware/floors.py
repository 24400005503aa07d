"""Roofline floors: the least time a forward pass can take on a device.

``floor_ms`` turns a task's counts (``hardware.counts``) into a time with a device probe
(``hardware.probe``): ``max(bytes / bandwidth, sum over dtypes of flops / rate)``. On cuda,
fp32 FLOPs of the op classes the run's math mode runs on TF32 tensor cores are charged at the
probe's TF32 rate.
"""
from __future__ import annotations

from typing import Any, Collection

from hardware.counts import RooflineCounts


def _rate_tflops(probe: Any, dtype: str) -> float:
    """The probe's FLOP rate for ``dtype``; the fastest measured rate when it has none for it
    (a faster rate gives a lower floor, so a missing rate never makes a floor too high)."""
    rates = {k: float(v) for k, v in (probe.tflops or {}).items() if v and float(v) > 0}
    if not rates:
        raise ValueError(f"probe for {probe.device_name} has no FLOP rates")
    return rates.get(dtype) or max(rates.values())


def floor_breakdown(counts: RooflineCounts, probe: Any, tf32: Collection[str]) -> dict[str, float]:
    """Memory time, compute time and their maximum (the floor), all in milliseconds.

    fp32 FLOPs of the op classes in ``tf32`` (``Numerics.tf32_classes`` of the run) are charged
    at the probe's ``tf32`` rate, the rest of each dtype's FLOPs at that dtype's rate.
    """
    if not probe.bandwidth_gbps or probe.bandwidth_gbps <= 0:
        raise ValueError(f"probe for {probe.device_name} has no bandwidth")
    memory_ms = counts.min_bytes / (probe.bandwidth_gbps * 1e9) * 1e3
    by_dtype = dict(counts.flops_by_dtype or ({counts.dtype: counts.flops} if counts.flops else {}))
    classes = set(tf32)
    tf32_flops = sum(n for c, n in counts.tf32_eligible.items() if c in classes)
    if tf32_flops and "fp32" in by_dtype:
        tf32_flops = min(tf32_flops, by_dtype["fp32"])
        by_dtype["fp32"] -= tf32_flops
        by_dtype["tf32"] = by_dtype.get("tf32", 0) + tf32_flops
    compute_ms = sum(n / (_rate_tflops(probe, dt) * 1e12) * 1e3 for dt, n in by_dtype.items() if n)
    return {"memory_ms": memory_ms, "compute_ms": compute_ms, "floor_ms": max(memory_ms, compute_ms)}


def floor_ms(counts: RooflineCounts, probe: Any, tf32: Collection[str]) -> float:
    """``max(bytes / bandwidth, flops / rate)`` in milliseconds, the rate of each FLOP's dtype."""
    return floor_breakdown(counts, probe, tf32)["floor_ms"]
