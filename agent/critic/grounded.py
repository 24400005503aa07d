"""The grounded critic: a deterministic analysis of a task's attempts from stored evidence.

It reads only what the sandbox stored (each attempt's ``EvalResult``), the attempt's
source and the task's source, and writes:

* per attempt, the verdict and its specific cause: the first compiler error and its line,
  the kind of CUDA error, wrong shapes, NaN/Inf where the reference is finite, where the
  outputs differ and by how much, the harness's flags, an empty answer; for correct
  attempts the runtime, the speedups, and why it is faster or slower as far as the
  profiles show it (which reference kernels are gone, which remain and their share, the
  candidate's own kernels, the fraction of the roofline floor);
* what static inspection of the source shows and the evidence agrees with (a sum of
  ``exp`` without max subtraction, a fixed-size array smaller than a dimension of the
  task, normalisation statistics computed without reducing over the group);
* a comparison table and what the next attempt should change.

Every figure it writes is a stored figure (or a documented one-step derivation of one),
written by ``agent.critic.numbers``'s formatters, with its unit; the tests check that.
Whether a task's floor is compute- or memory-bound is said only when the result carries
the floor and its FLOP and byte counts (``floor_ms``, ``floor_flops``, ``floor_bytes``) and
the device its measured bandwidth (see ``boundness``).
"""
from __future__ import annotations

from typing import Any, Optional

from agent.critic.base import register
from agent.critic.diagnosis import VERDICTS, Diagnosis, TaskContext, evidence_ref
from agent.critic.evidence_text import evidence_lines, reference_profile_lines  # noqa: F401  (re-exported)
from agent.critic.failures import (
    explain_compile_error,
    explain_load_error,
    explain_runtime_error,
    explain_timeout,
    explain_unparsed,
    flag_causes,
    latent_overflow,
    merged_flags,
)
from agent.critic.incorrect import explain_incorrect
from agent.critic.numbers import fmt_ms, fmt_pct, fmt_x, kernel_groups
from agent.critic.profile import (
    is_library_kernel,
    kernel_list,
    short_kernel_name,
    significant,
)
from agent.critic.source import (  # noqa: F401
    fixed_arrays,
    pytorch_calls_in_forward,
    task_constants,
    task_uses_group_norm,
    unstable_exp_sums,
)
from agent.critic.speed import explain_correct
from agent.critic.uncertainty import speed_cell
from agent.types import AnalysisOut, AttemptView, DeviceFacts, Finding
from sandbox.result import EvalResult, Status
from sandbox.tasks import TaskSpec, with_device_sizes


def diagnose(a: AttemptView, ctx: TaskContext) -> Diagnosis:
    r = a.result
    if r is None:
        return explain_unparsed(a, ctx)
    d = Diagnosis(a, VERDICTS.get(r.status, r.status.value), "")
    if r.status is Status.compile_error:
        explain_compile_error(a, r, d)
    elif r.status is Status.load_error:
        explain_load_error(a, r, d)
    elif r.status is Status.runtime_error:
        explain_runtime_error(a, r, d, ctx)
    elif r.status is Status.timeout:
        explain_timeout(a, r, d)
    elif r.status is Status.incorrect:
        explain_incorrect(a, r, d, ctx)
    elif r.status is Status.correct:
        explain_correct(a, r, d, ctx)
    flag_causes(a, r, d)
    if r.status in (Status.incorrect, Status.runtime_error, Status.timeout) and \
            not any(f.category in ("overflow", "nan_inf") for f in d.findings):
        latent_overflow(a, d, passed=False)
    flags = [f.kind.value.replace("_", " ") for f in merged_flags(r)]
    if flags:
        d.verdict += f" (flagged: {', '.join(flags)})"
    d.short = d.short.strip("; ") or d.verdict
    return d


# ======================================================================================
# The critic
# ======================================================================================

def task_context(task: TaskSpec, device: DeviceFacts) -> TaskContext:
    spec = with_device_sizes(task, device.device) if device else task
    return TaskContext(task=task, device=device,
                       constants=task_constants(spec.source, spec.overrides),
                       group_norm=task_uses_group_norm(task.source))


def _sort_key(a: AttemptView) -> tuple:
    return (a.round, a.sample, a.attempt_id)


def best_attempt(attempts: list[AttemptView]) -> Optional[AttemptView]:
    """The fastest clean correct attempt (no flag that casts doubt on it)."""
    ok = [a for a in attempts if a.result is not None and a.result.clean and a.result.candidate_time]
    return min(ok, key=lambda a: a.result.candidate_time.median_ms) if ok else None


def _table(diags: list[Diagnosis]) -> list[str]:
    rows = ["| attempt | round | verdict | runtime | vs eager | vs torch.compile | cause |",
            "|---|---|---|---|---|---|---|"]
    for d in diags:
        r = d.attempt.result
        rt = fmt_ms(r.candidate_time.median_ms) if r is not None and r.correct and r.candidate_time else "—"
        se = speed_cell(r, "eager") if r is not None and r.correct and r.speedup_eager is not None else "—"
        sc = speed_cell(r, "compile") if r is not None and r.correct and r.speedup_compile is not None else "—"
        cause = d.short.replace("|", "\\|")
        rows.append(f"| {d.attempt.attempt_id} | {d.attempt.round} | {d.verdict} | {rt} | {se} | {sc} | {cause} |")
    return rows


def _fusion_advice(r: EvalResult, best: AttemptView) -> str:
    groups = kernel_groups(r)
    kept = sorted(groups["kept"], key=lambda k: -k.share)
    own = groups["own"]
    own_names = ", ".join(f"`{short_kernel_name(k.name)}`" for k in own[:3]) or "its own kernels"
    kept = significant(kept)
    if kept:
        light = [k for k in kept if not is_library_kernel(k.name) and k.share >= 0.02]
        heavy = [k for k in kept if is_library_kernel(k.name)]
        if not heavy:
            light = light or kept[:1]
        if light:
            text = (f": keep its fused kernels ({own_names}) and fuse `{short_kernel_name(light[0].name)}` "
                    f"({fmt_pct(light[0].share)} "
                    f"of its time) next, into the kernel before or after it")
            if heavy:
                text += (f"; {kernel_list(heavy, 2)} of its time are library GEMM/convolution kernels: fuse the work "
                         f"around them into their prologue or epilogue rather than rewriting them")
            return text + "."
        return (f": keep its fused kernels ({own_names}); what remains from the reference is library "
                f"GEMM/convolution work ({kernel_list(heavy, 2)} of its time): fold the neighbouring elementwise "
                f"work into it (e.g. a GEMM epilogue), since beating the library itself needs a tuned kernel.")
    if own:
        text = (f": none of the reference's kernels remain; its own kernels take "
                f"{fmt_pct(sum(k.share for k in own))} of its time, so further gains come from making them faster")
        if r.floor_fraction is not None:
            text += f" (the roofline floor is {fmt_pct(r.floor_fraction)} of its runtime)"
        return text + "."
    calls = pytorch_calls_in_forward(best.source)
    if calls:
        return f": it still calls {', '.join(f'`{c}`' for c in calls[:4])} from PyTorch; fuse the next of these."
    return "."


def _next_steps(diags: list[Diagnosis], best: Optional[AttemptView]) -> list[str]:
    merged: dict[str, dict[str, Any]] = {}
    order = 0
    for d in diags:
        for prio, key, text in d.next_steps:
            entry = merged.setdefault(key, {"prio": prio, "order": order, "text": text, "attempts": []})
            order += 1
            if prio < entry["prio"]:
                entry["prio"], entry["text"] = prio, text
            if d.attempt.attempt_id not in entry["attempts"]:
                entry["attempts"].append(d.attempt.attempt_id)
    steps: list[tuple[int, int, str]] = []
    if best is not None:
        r = best.result
        base = (f"Start from attempt {best.attempt_id}, the fastest clean correct attempt "
                f"({fmt_ms(r.candidate_time.median_ms)}"
                + (f", {fmt_x(r.speedup_eager)} vs eager" if r.speedup_eager is not None else "") + ")")
        steps.append((0, -1, base + _fusion_advice(r, best)))
    for e in merged.values():
        ids = e["attempts"]
        who = (f"Attempt {ids[0]}" if len(ids) == 1 else
               "Attempts " + ", ".join(str(i) for i in ids[:-1]) + f" and {ids[-1]}")
        steps.append((e["prio"], e["order"], f"{who}: {e['text']}"))
    if best is None and not any(d.attempt.correct for d in diags):
        steps.append((4, order, "No attempt is correct yet: get one correct version first (fuse the cheap "
                                "elementwise tail and keep PyTorch for the rest), then fuse more."))
    return [text for _, _, text in sorted(steps)]


@register("grounded")
class GroundedCritic:
    """Deterministic, offline: everything it says comes from stored evidence and the sources."""

    name = "grounded"

    def __init__(self, **_options: Any):
        pass

    def diagnose(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> list[Diagnosis]:
        ctx = task_context(task, device)
        return [diagnose(a, ctx) for a in sorted(attempts, key=_sort_key)]

    def analyze(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> AnalysisOut:
        diags = self.diagnose(task, attempts, device)
        best = best_attempt(attempts)
        lines: list[str] = [f"# Analysis of `{task.name}`", ""]
        dev = f"{device.device}" + (f", `{device.name}`" if device.name else "") + \
            (f", torch `{device.torch_version}`" if device.torch_version else "")
        counts: dict[str, int] = {}
        for d in diags:
            key = d.verdict.split(" (")[0]
            counts[key] = counts.get(key, 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in counts.items())
        lines.append(f"Device: {dev}. {len(diags)} attempt{'s' if len(diags) != 1 else ''}: {summary or 'none'}.")
        if best is not None:
            r = best.result
            line = f"Best: attempt {best.attempt_id}, {fmt_ms(r.candidate_time.median_ms)}"
            if r.speedup_eager is not None:
                line += f", {speed_cell(r, 'eager')} vs eager"
            if r.speedup_compile is not None:
                line += f", {speed_cell(r, 'compile')} vs torch.compile"
            lines.append(line + ".")
        elif not any(d.attempt.correct for d in diags):
            lines.append("No attempt is correct yet.")
        else:
            lines.append("The correct attempts all carry flags that cast doubt on them (see below).")
        lines += ["", "## Attempts", ""]
        for d in diags:
            a = d.attempt
            lines.append(f"### Attempt {a.attempt_id} (round {a.round}, sample {a.sample}): {d.verdict}")
            lines.append("")
            for b in d.bullets:
                lines.append(f"- {b}")
            lines.append("")
        lines += ["## Comparison", ""] + _table(diags) + [""]
        steps = _next_steps(diags, best)
        lines += ["## What the next attempt should change", ""]
        lines += [f"{i}. {s}" for i, s in enumerate(steps, 1)] if steps else ["- Nothing to change."]
        findings = [f for d in diags for f in d.findings]
        if best is not None:
            r = best.result
            findings.append(Finding(attempt_id=best.attempt_id, category="best",
                                    cause=f"fastest clean correct attempt: {fmt_ms(r.candidate_time.median_ms)}",
                                    evidence=[evidence_ref(best, "candidate_time.median_ms", r.candidate_time.median_ms)],
                                    numbers={"median_ms": r.candidate_time.median_ms,
                                             "speedup_eager": r.speedup_eager}))
        for s in steps:
            findings.append(Finding(attempt_id=None, category="next_step", cause=s))
        return AnalysisOut(critic=self.name, markdown="\n".join(lines).rstrip() + "\n", findings=findings)
