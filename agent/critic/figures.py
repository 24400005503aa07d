"""The figures an analysis may quote: every stored figure of a task's attempts and the device,
each with its dimension, plus the documented one-step derivations (a fraction as a percentage,
the sum of a group of kernels' shares, the ratio of two stored runtimes).

``agent.critic.numbers`` checks quoted numbers against these.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from agent.critic.patterns import classify, pattern_numbers
from sandbox.blocks import block_ratios, leave_one_out, split_blocks
from sandbox.intervals import relative_spread, speedup_interval


@dataclass
class Figure:
    value: float        # in the dimension's base unit (ms, x, %, GB/s, FLOP/s, FLOP, B, plain)
    dimension: str
    source: str         # where it comes from: "attempt 3: candidate_time.median_ms"


@dataclass
class Evidence:
    figures: list[Figure] = field(default_factory=list)

    def add(self, value: Any, dimension: str, source: str) -> None:
        if value is None or isinstance(value, bool):
            return
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        if math.isfinite(v):
            self.figures.append(Figure(v, dimension, source))

    def by_dimension(self, dimension: str) -> list[Figure]:
        return [f for f in self.figures if f.dimension == dimension]

    def extend(self, other: "Evidence") -> None:
        self.figures.extend(other.figures)


def _timing(ev: Evidence, timing: Any, where: str) -> None:
    if timing is None:
        return
    for name in ("median_ms", "iqr_ms", "mean_ms", "min_ms", "max_ms"):
        ev.add(getattr(timing, name, None), "time", f"{where}.{name}")
    ev.add(getattr(timing, "runs", None), "plain", f"{where}.runs")


def _blocks(ev: Evidence, result: Any, where: str) -> None:
    """``cpu``'s interleaved blocks (``sandbox.blocks``): each side's block medians, the block pairs'
    eager/candidate ratios and the speedup with each pair left out (the burst flag quotes them)."""
    per_side = {name: split_blocks(getattr(result, name)) for name in ("candidate_time", "eager_time", "compile_time")
                if getattr(result, name) is not None}
    for name, blocks in per_side.items():
        for i, b in enumerate(blocks or []):
            # quoted as a list ("eager blocks 1.55, 1.34, 1.34 ms"): all but the last without the unit
            ev.add(statistics.median(b), "time", f"{where}: {name} block {i + 1} median")
            ev.add(statistics.median(b), "plain", f"{where}: {name} block {i + 1} median (in a list of ms)")
    cand, eager = per_side.get("candidate_time"), per_side.get("eager_time")
    if not cand or not eager or len(cand) != len(eager):
        return
    for i, r in enumerate(block_ratios(cand, eager)):
        ev.add(r, "plain", f"{where}: block {i + 1} eager/candidate ratio")
    for i, r in enumerate(leave_one_out(cand, eager)):
        ev.add(r, "ratio", f"{where}: speedup_eager without block {i + 1}")


def is_annotation(k: Any, profile: list[Any]) -> bool:
    """A ``kernelloop_ext::*`` row of a profile that also lists device kernels of the candidate's
    own: the range the harness records around each call into the extension, which covers those
    kernels' time rather than adding to it (on ``cpu`` it is the only row for that work)."""
    return k.name.startswith("kernelloop_ext::") and any(
        o.own and not o.name.startswith("kernelloop_ext::") for o in profile)


def kernel_groups(result: Any) -> dict[str, list[Any]]:
    """The candidate's and the reference's kernels split the way the critic discusses them."""
    ref = list(result.reference_profile or [])
    cand = [k for k in (result.profile or []) if not is_annotation(k, result.profile)]
    ref_names = {k.name for k in ref}
    cand_names = {k.name for k in cand}
    return {
        "removed": [k for k in ref if k.name not in cand_names],          # in reference's profile
        "kept_ref": [k for k in ref if k.name in cand_names],             # in reference's profile
        "kept": [k for k in cand if k.name in ref_names and not k.own],   # in candidate's profile
        "own": [k for k in cand if k.own],
        "other": [k for k in cand if not k.own and k.name not in ref_names],
    }


def busy_ms(profile: list[Any]) -> float:
    """Milliseconds the GPU ran a profile's kernels in one forward (its rows' ``total_us`` summed)."""
    return sum(k.total_us for k in profile) / 1e3


def result_evidence(result: Any, label: str) -> Evidence:
    """Every figure one ``EvalResult`` stores, plus the documented one-step derivations."""
    ev = Evidence()
    w = label
    ev.add(result.seconds * 1e3 if result.seconds is not None else None, "time", f"{w}: seconds")
    cfg = result.config
    if cfg is not None:
        ev.add(cfg.build_timeout_s * 1e3, "time", f"{w}: config.build_timeout_s")
        ev.add(cfg.run_timeout_s * 1e3, "time", f"{w}: config.run_timeout_s")
        for name in ("trials", "warmup_runs", "timed_runs"):
            ev.add(getattr(cfg, name), "plain", f"{w}: config.{name}")
        tol = cfg.numerics.tolerance
        ev.add(tol.atol, "plain", f"{w}: config.numerics.tolerance.atol")
        ev.add(tol.rtol, "plain", f"{w}: config.numerics.tolerance.rtol")
        for name in ("elem_factor", "rms_factor", "rms_slack_eps"):
            ev.add(getattr(cfg.numerics, name), "plain", f"{w}: config.numerics.{name}")
        if cfg.memory_limit_mb:
            ev.add(cfg.memory_limit_mb * 1e6, "bytes", f"{w}: config.memory_limit_mb")
    if result.build is not None:
        ev.add(result.build.seconds * 1e3, "time", f"{w}: build.seconds")
        ev.add(result.build.first_error_line, "plain", f"{w}: build.first_error_line")
    _timing(ev, result.candidate_time, f"{w}: candidate_time")
    _timing(ev, result.eager_time, f"{w}: eager_time")
    _timing(ev, result.compile_time, f"{w}: compile_time")
    for t_name in ("candidate_time", "eager_time", "compile_time"):
        t = getattr(result, t_name)
        rel = relative_spread(t)
        if rel is not None:
            ev.add(rel * 100.0, "percent", f"{w}: {t_name}.iqr_ms / median_ms")
        if t is not None:
            ev.add(getattr(t, "host_load", None), "plain", f"{w}: {t_name}.host_load")
    _blocks(ev, result, w)
    for base_name in ("eager_time", "compile_time"):
        iv = speedup_interval(getattr(result, base_name), result.candidate_time)
        if iv is not None:
            ev.add(iv.low, "ratio", f"{w}: {base_name} speedup interval low ({iv.method})")
            ev.add(iv.high, "ratio", f"{w}: {base_name} speedup interval high ({iv.method})")
            ev.add(iv.level * 100.0, "percent", f"{w}: interval level")
            ev.add(1.0, "ratio", "the ratio 1x an interval is compared with")
    ev.add(result.speedup_eager, "ratio", f"{w}: speedup_eager")
    ev.add(result.speedup_compile, "ratio", f"{w}: speedup_compile")
    if result.eager_time and result.compile_time and result.compile_time.median_ms:
        ev.add(result.eager_time.median_ms / result.compile_time.median_ms, "ratio",
               f"{w}: eager_time.median_ms / compile_time.median_ms")
    ev.add(result.custom_calls_per_forward, "plain", f"{w}: custom_calls_per_forward")
    ev.add(result.floor_ms, "time", f"{w}: floor_ms")
    if result.floor_fraction is not None:
        ev.add(result.floor_fraction * 100.0, "percent", f"{w}: floor_fraction")
        ev.add(result.floor_fraction, "plain", f"{w}: floor_fraction")
    # optional roofline details (present when the sandbox stores them)
    for name, dim, factor in (("floor_flops", "flops", 1.0), ("floor_bytes", "bytes", 1.0),
                              ("flops", "flops", 1.0), ("min_bytes", "bytes", 1.0)):
        ev.add(getattr(result, name, None), dim, f"{w}: {name}")
    for t in result.trials:
        ev.add(t.index, "plain", f"{w}: trials[{t.index}].index")
        for o in t.outputs:
            where = f"{w}: trials[{t.index}].outputs[{o.index}]"
            ev.add(o.max_abs_err, "plain", f"{where}.max_abs_err")
            ev.add(o.max_rel_err, "plain", f"{where}.max_rel_err")
            for name in ("mismatched", "numel", "nan_count", "inf_count", "ref_nonfinite", "index"):
                ev.add(getattr(o, name), "plain", f"{where}.{name}")
            if o.numel:
                ev.add(100.0 * o.mismatched / o.numel, "percent", f"{where}.mismatched / numel")
                ev.add(100.0 * (o.nan_count + o.inf_count) / o.numel, "percent",
                       f"{where}.(nan_count + inf_count) / numel")
            ev.add(o.tolerance.atol, "plain", f"{where}.tolerance.atol")
            ev.add(o.tolerance.rtol, "plain", f"{where}.tolerance.rtol")
            for d in list(o.shape) + list(o.ref_shape) + list(o.bad_rows or []):
                ev.add(d, "plain", f"{where}.shape")
            patterns = classify(getattr(o, "locations", None), o.numel)
            for v in pattern_numbers(patterns):
                ev.add(v, "plain", f"{where}.locations")
            for p in patterns:
                if p.kind == "scale":                      # "2.000 times the reference's value"
                    ev.add(p.numbers["factor"], "ratio", f"{where}.locations.values.ratio_min")
                    ev.add(p.numbers["factor_max"], "ratio", f"{where}.locations.values.ratio_max")
    failed = [t for t in result.trials if not t.passed]
    if result.trials:
        ev.add(len(result.trials), "plain", f"{w}: number of trials")
        ev.add(len(failed), "plain", f"{w}: number of failed trials")
    for prof_name, prof in (("profile", result.profile), ("reference_profile", result.reference_profile)):
        for k in prof or []:
            ev.add(k.share * 100.0, "percent", f"{w}: {prof_name}[{k.name}].share")
            ev.add(k.total_us / 1e3, "time", f"{w}: {prof_name}[{k.name}].total_us")
            ev.add(k.count, "plain", f"{w}: {prof_name}[{k.name}].count")
    groups = kernel_groups(result)
    for gname, ks in groups.items():
        if not ks:
            continue
        ev.add(100.0 * sum(k.share for k in ks), "percent", f"{w}: sum of {gname} kernels' shares")
        ev.add(sum(k.total_us for k in ks) / 1e3, "time", f"{w}: sum of {gname} kernels' total_us")
        ev.add(len(ks), "plain", f"{w}: number of {gname} kernels")
    for name in ("profile", "reference_profile"):
        ev.add(len(getattr(result, name) or []), "plain", f"{w}: number of {name} kernels")
    # the GPU's busy time per forward, and its share of the side's median (a launch-bound forward)
    for prof_name, timing in (("profile", result.candidate_time), ("reference_profile", result.eager_time)):
        prof = getattr(result, prof_name) or []
        if prof:
            busy = busy_ms(prof)
            ev.add(busy, "time", f"{w}: sum of {prof_name} kernels' total_us")
            if timing is not None and timing.median_ms > 0:
                ev.add(100.0 * busy / timing.median_ms, "percent", f"{w}: {prof_name} busy share of its median")
    return ev


def device_evidence(device: Any) -> Evidence:
    ev = Evidence()
    if device is None:
        return ev
    ev.add(getattr(device, "bandwidth_gbps", None), "bandwidth", "device.bandwidth_gbps")
    ev.add(getattr(device, "sm_count", None), "plain", "device.sm_count")
    for dtype, tflops in (getattr(device, "tflops", None) or {}).items():
        ev.add(tflops * 1e12 if tflops is not None else None, "rate", f"device.tflops[{dtype}]")
    return ev


def evidence_figures(attempts: Iterable[Any], device: Any = None) -> Evidence:
    """The figures a task's analysis may quote: each attempt's stored result and the device."""
    attempts = list(attempts)
    ev = Evidence()
    times: list[tuple[str, float]] = []
    for a in attempts:
        label = f"attempt {a.attempt_id}"
        for v, name in ((a.attempt_id, "attempt_id"), (a.round, "round"), (a.sample, "sample"),
                        (a.evaluation_id, "evaluation_id")):
            ev.add(v, "plain", f"{label}: {name}")
        if a.result is None:
            continue
        ev.extend(result_evidence(a.result, label))
        r = a.result
        if r.correct and r.candidate_time is not None:
            times.append((label, r.candidate_time))
            # the seeds' "Runtime: 1.6" (the median in ms, written without its unit)
            ev.add(r.candidate_time.median_ms, "plain", f"{label}: candidate_time.median_ms (seed runtime)")
        derived = getattr(a, "derived_evidence", None)
        if derived:
            ev.extend(derived)
    # ratios of two correct attempts' runtimes ("attempt 4 is 1.35x faster than attempt 2")
    # and their intervals ("..., 95% interval 1.20x-1.51x")
    for i, (la, ta) in enumerate(times):
        for lb, tb in times[i + 1:]:
            for (l1, t1), (l2, t2) in (((la, ta), (lb, tb)), ((lb, tb), (la, ta))):
                iv = speedup_interval(t1, t2)
                if iv is not None:
                    ev.add(iv.point, "ratio", f"{l1} / {l2} median_ms")
                    ev.add(iv.low, "ratio", f"{l1} / {l2} interval low")
                    ev.add(iv.high, "ratio", f"{l1} / {l2} interval high")
    ev.add(len(attempts), "plain", "number of attempts")
    ev.add(sum(1 for a in attempts if a.correct), "plain", "number of correct attempts")
    ev.extend(device_evidence(device))
    return ev
