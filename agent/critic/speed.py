"""Why a correct attempt is faster or slower: its speed against eager (within its interval,
``agent.critic.uncertainty``) and what the profiles show."""
from __future__ import annotations

from typing import Any, Optional

from agent.critic.diagnosis import Diagnosis, TaskContext, evidence_ref
from agent.critic.failures import latent_overflow
from agent.critic.figures import busy_ms
from agent.critic.numbers import (
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_us,
    fmt_x,
    kernel_groups,
    sig,
)
from agent.critic.profile import boundness, kernel_list, short_kernel_name, significant
from agent.critic.source import pytorch_calls_in_forward
from agent.critic.uncertainty import speed_claim
from agent.types import AttemptView
from sandbox.result import EvalResult, FlagKind


def speed_vs_eager(r: EvalResult) -> Optional[str]:
    """faster | slower | inconclusive, as the speedup's interval says; None without a speedup."""
    claim = speed_claim(r, "eager")
    return claim.label if claim is not None else None


def explain_correct(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    n = len(r.trials)
    numbers: dict[str, Any] = {}
    evidence = [evidence_ref(a, "status", r.status.value)]
    parts = [f"Correct in all {n} trials" if n else "Correct"]
    if r.candidate_time:
        numbers["median_ms"] = r.candidate_time.median_ms
        evidence.append(evidence_ref(a, "candidate_time.median_ms", r.candidate_time.median_ms))
        parts.append(f"median runtime {fmt_ms(r.candidate_time.median_ms)}")
    comps = []
    if r.eager_time and r.speedup_eager is not None:
        numbers["eager_ms"] = r.eager_time.median_ms
        numbers["speedup_eager"] = r.speedup_eager
        comps.append(f"eager {fmt_ms(r.eager_time.median_ms)}, {fmt_x(r.speedup_eager)}")
    if r.compile_time and r.speedup_compile is not None:
        numbers["compile_ms"] = r.compile_time.median_ms
        numbers["speedup_compile"] = r.speedup_compile
        comps.append(f"torch.compile {fmt_ms(r.compile_time.median_ms)}, {fmt_x(r.speedup_compile)}")
    text = "; ".join(parts)
    if comps:
        text += " (vs " + "; vs ".join(comps) + ")"
    d.add("correct", text + ".", evidence, numbers)

    groups = kernel_groups(r)
    removed, kept, own, other = groups["removed"], groups["kept"], groups["own"], groups["other"]
    details: list[str] = []            # sub-bullets: what the profiles show
    summary: list[str] = []            # the finding's one-sentence cause
    why_numbers: dict[str, Any] = {}
    profiled = bool(r.reference_profile and r.profile)
    if profiled:
        removed_us = sum(k.total_us for k in removed)
        own_us = sum(k.total_us for k in own)
        if removed:
            details.append(f"no longer running (fused or replaced): the reference's {kernel_list(removed)} "
                           f"of the reference's time, {fmt_us(removed_us)} in its profile")
            why_numbers["removed_share"] = sum(k.share for k in removed)
            why_numbers["removed_us"] = removed_us
            summary.append(f"the reference's {kernel_list(significant(removed) or removed, 2)} no longer run")
        if own:
            details.append(f"its own kernels: {kernel_list(own)} of its time, {fmt_us(own_us)} in its profile")
            why_numbers["own_share"] = sum(k.share for k in own)
            why_numbers["own_us"] = own_us
            summary.append(f"its own kernels take {fmt_pct(sum(k.share for k in own))} of its time")
        if removed and own:
            summary.append(f"in the profiles its own kernels take {fmt_us(own_us)} where the reference's "
                           f"kernels they replace took {fmt_us(removed_us)}")
            if speed_vs_eager(r) in ("faster", "slower") and (r.speedup_eager < 1.0) == (own_us < removed_us):
                note = ("the profiles do not account for the difference: its own kernels take "
                        f"{'less' if own_us < removed_us else 'more'} time than the kernels they replace, "
                        f"so the rest of its time (or run-to-run variation) decides")
                details.append(note)
                summary.append(note)
        if kept:
            details.append(f"still running from the reference: {kernel_list(kept)}, together "
                           f"{fmt_pct(sum(k.share for k in kept))} of its time")
            why_numbers["kept_share"] = sum(k.share for k in kept)
            summary.append(f"the reference's {kernel_list(kept, 2)} still run "
                           f"({fmt_pct(sum(k.share for k in kept))} of its time)")
        if other:
            details.append(f"new work the reference does not do: {kernel_list(other)} of its time "
                           f"(copies, allocations or extra ops)")
            why_numbers["other_share"] = sum(k.share for k in other)
        launch = launch_bound(a, r)
        if launch:
            details.append(launch[0])
            summary.append(launch[0])
            why_numbers.update(launch[1])
    elif r.profile and own:
        details.append(f"its own kernels: {kernel_list(own)} of its time")
        why_numbers["own_share"] = sum(k.share for k in own)
        summary.append(f"its own kernels take {fmt_pct(sum(k.share for k in own))} of its time")
    static_calls = pytorch_calls_in_forward(a.source)
    if not profiled and static_calls:
        details.append("from the source: its forward still calls " +
                       ", ".join(f"`{c}`" for c in static_calls[:5]) + " from PyTorch")
    if r.floor_fraction is not None and r.floor_ms is not None:
        details.append(f"the roofline floor ({fmt_ms(r.floor_ms)}) is {fmt_pct(r.floor_fraction)} of its runtime")
        why_numbers["floor_fraction"] = r.floor_fraction
        why_numbers["floor_ms"] = r.floor_ms
    bound = boundness(r, ctx.device)
    if bound:
        kind, bn = bound
        if kind == "memory-bound":
            details.append(f"the floor is memory-bound: moving its {fmt_num(bn['floor_bytes'])} bytes at the "
                           f"device's {sig(bn['bandwidth_gbps'], 4)} GB/s takes the whole floor; its "
                           f"{fmt_num(bn['floor_flops'])} FLOP take less")
        else:
            details.append(f"the floor is compute-bound: moving its {fmt_num(bn['floor_bytes'])} bytes at the "
                           f"device's {sig(bn['bandwidth_gbps'], 4)} GB/s takes less than the floor, so its "
                           f"{fmt_num(bn['floor_flops'])} FLOP set it")
        why_numbers.update(bn)

    # a "fusion" that is PyTorch's own work (no kernel of its own ran, or a fallback path) is none
    flagged = {f.kind for f in r.flags} & {FlagKind.no_custom_kernel, FlagKind.fallback}
    partial = bool(own and kept) or (not profiled and bool(static_calls) and bool(r.custom_calls_per_forward))
    claim = speed_claim(r, "eager")
    speed = claim.label if claim is not None else None
    if claim is not None:
        cat = speed
        lead = claim.sentence
        if summary:
            cause = lead + ". Where the time goes: " + "; ".join(summary) + "."
        elif details:
            cause = lead + "."
        else:
            cause = lead + "; no profile was stored, so the evidence does not say where the time goes."
        bullet = cause if not details else lead + ". From the evidence:" + "".join(
            f"\n  - {x}" for x in details)
        d.add(cat, cause, [evidence_ref(a, "speedup_eager", r.speedup_eager)],
              {"speedup_eager": r.speedup_eager, "interval_low": claim.interval.low,
               "interval_high": claim.interval.high, "interval_method": claim.interval.method,
               **{k: v for k, v in claim.numbers.items() if k not in ("speedup", "low", "high")}, **why_numbers},
              bullet=bullet)
    elif details:
        d.add("profile", "From the evidence: " + "; ".join(details) + ".", [], why_numbers)

    if partial and not flagged:
        kept_names = ", ".join(f"`{short_kernel_name(k.name)}`" for k in (significant(kept) or kept)[:3]) if kept else \
            ", ".join(f"`{c}`" for c in static_calls[:4])
        d.add("partial_fusion",
              f"A correct partial fusion: its own kernels replace part of the model while PyTorch still runs "
              f"{kept_names}; fusing less than the whole model does not make it incorrect.",
              [evidence_ref(a, "status", "correct")])
    latent_overflow(a, d)

    short = "correct"
    if partial and not flagged:
        short += ", partial fusion"
    if speed is not None:
        short += {"faster": ", faster than eager", "slower": ", slower than eager",
                  "inconclusive": ", speed vs eager inconclusive"}[speed]
    if any(f.category == "latent_overflow" for f in d.findings):
        short += ", latent overflow risk"
    d.short = short


LAUNCH_BOUND = 0.5      # the reference's kernels busy for at most this share of its eager forward


def launch_bound(a: AttemptView, r: EvalResult) -> Optional[tuple[str, dict[str, Any]]]:
    """Where the reference's kernels fill at most half of its eager forward, the rest is the host
    launching them: the sentence saying so (with the candidate's own busy share, and whether it
    replays its forward from a CUDA graph), and its numbers. None otherwise."""
    if not (r.reference_profile and r.profile and r.eager_time and r.candidate_time):
        return None
    ref_ms, cand_ms = busy_ms(r.reference_profile), busy_ms(r.profile)
    eager, cand = r.eager_time.median_ms, r.candidate_time.median_ms
    if eager <= 0 or cand <= 0 or ref_ms > LAUNCH_BOUND * eager:
        return None
    graph = "_kl_graphed(" in (a.source or "") or "a CUDA graph replaying them" in (r.stderr or "")
    text = (f"the reference is launch-bound: its kernels run {fmt_ms(ref_ms)} of its {fmt_ms(eager)} forward "
            f"({fmt_pct(ref_ms / eager)}), the rest is the host launching them; the candidate's kernels run "
            f"{fmt_ms(cand_ms)} of its {fmt_ms(cand)}"
            + (", its forward replayed from a CUDA graph (one launch)" if graph else ""))
    return text, {"reference_busy_ms": ref_ms, "candidate_busy_ms": cand_ms, "graph_replay": graph}

