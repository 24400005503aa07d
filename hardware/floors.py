"""Roofline floors: the least time a forward pass can take on a device, for any legitimate kernel.

``floor_breakdown`` turns a task's counts (``hardware.counts``) into a time with a device probe
(``hardware.probe``): ``max(bytes / bandwidth, compute)``, where compute charges each FLOP at
the fastest arithmetic a candidate is allowed under the run's numerics:

* fp16 / bf16 FLOPs at that dtype's tensor-core rate, one pass;
* fp32 FLOPs of the op classes the run's math mode itself runs in TF32 (``tf32``: cuDNN
  convolutions under PyTorch's default) in one pass of 10-bit-mantissa tensor-core arithmetic
  (TF32, or fp16 operands, which carry the same mantissa): the reference is no more exact;
* fp32 convolution FLOPs in one such pass under any math mode: FFT and Winograd algorithms
  (cuDNN's, in IEEE fp32 too) do a fraction of a direct convolution's FLOPs, so three passes over
  the direct count would be no bound (``strict`` eager beat the fp32 rate on level2 convs);
* every other fp32 FLOP as split-TF32 (3xTF32: three tensor-core passes over hi/lo halves,
  about as accurate as fp32 SGEMM, which the float64 rule accepts), unless plain fp32 is faster
  (on cpu there is no tensor core: fp32 at the fp32 rate).

The probe's ceilings are its best runs, which a kernel with a luckier access pattern can pass by
a few percent; the floor raises them by ``CEILING_SLACK`` so that no legitimate kernel crosses
it: a floor fraction (floor / runtime) is then at most 100% for every honest kernel, and the
sandbox flags one that crosses it ``impossible``. ``arithmetic`` names what a floor assumed.
"""
from __future__ import annotations

from typing import Any, Collection

from hardware.counts import RooflineCounts

CEILING_SLACK = 1.05      # measured ceilings raised 5%
SPLIT_PASSES = 3          # 3xTF32: hi*hi + hi*lo + lo*hi
# What a floor fraction is, in words, wherever one is shown.
CONVENTION = ("floor fraction = roofline floor / runtime; floor = max(bytes at the probed bandwidth, FLOPs at the "
              "fastest arithmetic the run's numerics allow: one TF32 pass for convolutions and where its math mode "
              f"runs TF32, 3xTF32 for other fp32, fp16/bf16 at their rates), ceilings +{CEILING_SLACK - 1:.0%}")


def _rates(probe: Any) -> dict[str, float]:
    rates = {k: float(v) for k, v in (probe.tflops or {}).items() if v and float(v) > 0}
    if not rates:
        raise ValueError(f"probe for {probe.device_name} has no FLOP rates")
    return rates


def _rate_tflops(probe: Any, dtype: str) -> float:
    """The probe's FLOP rate for ``dtype``; the fastest measured rate when it has none for it
    (a faster rate gives a lower floor, so a missing rate never makes a floor too high)."""
    rates = _rates(probe)
    return rates.get(dtype) or max(rates.values())


def _tensor_core_10bit(probe: Any) -> float:
    """The fastest rate of 10-bit-mantissa tensor-core arithmetic (TF32, fp16); 0 on a probe without one."""
    rates = _rates(probe)
    return max(rates.get("tf32", 0.0), rates.get("fp16", 0.0)) if getattr(probe, "device", "cuda") == "cuda" else 0.0


def floor_breakdown(counts: RooflineCounts, probe: Any, tf32: Collection[str]) -> dict[str, Any]:
    """Memory time, compute time and their maximum (the floor), all in milliseconds, and
    ``arithmetic``: the assumptions in words.

    ``tf32``: the op classes (``conv``, ``matmul``) whose fp32 FLOPs the run's math mode runs in
    TF32 (``Numerics.tf32_classes``): those and convolutions get one tensor-core pass, other fp32
    FLOPs three.
    """
    if not probe.bandwidth_gbps or probe.bandwidth_gbps <= 0:
        raise ValueError(f"probe for {probe.device_name} has no bandwidth")
    bandwidth = probe.bandwidth_gbps * CEILING_SLACK
    memory_ms = counts.min_bytes / (bandwidth * 1e9) * 1e3
    by_dtype = dict(counts.flops_by_dtype or ({counts.dtype: counts.flops} if counts.flops else {}))
    fp32 = by_dtype.pop("fp32", 0)
    single = set(tf32) | {"conv"}
    one_pass = min(fp32, sum(n for c, n in counts.tf32_eligible.items() if c in single))
    split = fp32 - one_pass
    tc = _tensor_core_10bit(probe) * CEILING_SLACK
    fp32_rate = _rate_tflops(probe, "fp32") * CEILING_SLACK
    words = []
    compute_ms = sum(n / (_rate_tflops(probe, dt) * CEILING_SLACK * 1e12) * 1e3 for dt, n in by_dtype.items() if n)
    words += [f"{dt} at its rate" for dt, n in by_dtype.items() if n]
    if one_pass:
        rate = tc or fp32_rate
        compute_ms += one_pass / (rate * 1e12) * 1e3
        words.append("fp32 " + "/".join(sorted(c for c in single if counts.tf32_eligible.get(c)))
                     + (" in one TF32 pass" if tc else " at the fp32 rate"))
    if split:
        if tc and tc / SPLIT_PASSES > fp32_rate:
            compute_ms += split * SPLIT_PASSES / (tc * 1e12) * 1e3
            words.append("other fp32 as 3xTF32")
        else:
            compute_ms += split / (fp32_rate * 1e12) * 1e3
            words.append("fp32 at the fp32 rate")
    words.append("bytes at the probed bandwidth")
    return {"memory_ms": memory_ms, "compute_ms": compute_ms, "floor_ms": max(memory_ms, compute_ms),
            "arithmetic": "; ".join(words) + f" (ceilings +{CEILING_SLACK - 1:.0%})"}


def floor_ms(counts: RooflineCounts, probe: Any, tf32: Collection[str]) -> float:
    """The floor in milliseconds (``floor_breakdown``)."""
    return floor_breakdown(counts, probe, tf32)["floor_ms"]
