"""An attempt's stored evidence as lines of text (for prompts and reports), written with the
same formatters as the analyses."""
from __future__ import annotations

from typing import Optional

from agent.critic.diagnosis import code_span, fmt_err, int_or_sig
from agent.critic.numbers import fmt_ms, fmt_num, fmt_pct, fmt_s, fmt_x, is_annotation, sig
from agent.critic.patterns import classify
from agent.critic.profile import short_kernel_name
from agent.critic.source import source_line
from agent.critic.uncertainty import speed_claim
from agent.types import AttemptView
from sandbox.result import Status


def _cap(text: Optional[str], limit: int = 400) -> str:
    t = " ".join((text or "").split())
    return t if len(t) <= limit else t[:limit - 3] + "..."


def evidence_lines(a: AttemptView, max_kernels: int = 8) -> list[str]:
    """One attempt's stored evidence, one fact a line, figures with their units."""
    lines: list[str] = []
    r = a.result
    if r is None:
        lines.append(f"parse status: {a.parse_status}" + (f" ({code_span(a.parse_error, 300)})" if a.parse_error else "")
                     + "; not built or run")
        return lines
    lines.append(f"status: {r.status.value}")
    if r.build is not None:
        b = r.build
        text = f"build: {'ok' if b.ok else 'failed'}"
        if b.first_error:
            text += f"; first compiler error {code_span(b.first_error, 300)}"
        if b.first_error_line:
            text += f" at line {b.first_error_line} of the candidate"
            src = source_line(a.source, b.first_error_line)
            if src:
                text += f" ({code_span(src, 160)})"
        lines.append(text)
    if r.error_type or r.error_message:
        lines.append(f"error: {code_span((r.error_type or '') + ': ' + _cap(r.error_message, 400))}")
    if r.status is Status.timeout:
        lines.append(f"limits: build {fmt_s(r.config.build_timeout_s)}, run {fmt_s(r.config.run_timeout_s)}")
    if r.trials:
        passed = sum(1 for t in r.trials if t.passed)
        lines.append(f"trials: {passed} of {len(r.trials)} passed")
        t = r.first_failed_trial()
        if t is not None:
            if t.reason:
                lines.append(f"trial {t.index} failed: {code_span(t.reason, 300)}")
            for o in t.outputs:
                parts = [f"output {o.index}: shape {list(o.shape)} ({o.dtype}) vs reference {list(o.ref_shape)} "
                         f"({o.ref_dtype})"]
                if o.mismatched:
                    parts.append(f"{o.mismatched} of {o.numel} elements outside atol {fmt_num(o.tolerance.atol)} / "
                                 f"rtol {fmt_num(o.tolerance.rtol)}")
                if o.max_abs_err is not None:
                    parts.append(f"max abs error {fmt_err(o.max_abs_err)}")
                if o.max_rel_err is not None:
                    parts.append(f"max rel error {fmt_err(o.max_rel_err)}")
                if o.nan_count or o.inf_count:
                    parts.append(f"{o.nan_count} NaN and {o.inf_count} Inf where the reference is finite")
                patterns = classify(o.locations, o.numel)
                if patterns:
                    parts.append("error pattern: " + "; ".join(f"[{p.kind}] {p.sentence}" for p in patterns))
                else:
                    if o.mismatch_pattern:
                        parts.append(f"pattern: {o.mismatch_pattern}")
                    if o.bad_rows:
                        parts.append("first bad rows: " + ", ".join(str(x) for x in o.bad_rows[:8]))
                lines.append("; ".join(parts))
    if r.candidate_time:
        ct = r.candidate_time
        lines.append(f"runtime: median {fmt_ms(ct.median_ms)} (IQR {fmt_ms(ct.iqr_ms)}, {ct.runs} runs, "
                     f"clock {ct.clock}" + (f", in {ct.blocks} blocks interleaved with the reference's (ABBA)"
                                            if (ct.blocks or 1) > 1 else "")
                     + (f", host load {sig(ct.host_load, 3)} per CPU" if ct.host_load else "")
                     + ")")
    if r.eager_time:
        text = f"eager PyTorch: median {fmt_ms(r.eager_time.median_ms)} (IQR {fmt_ms(r.eager_time.iqr_ms)})"
        claim = speed_claim(r, "eager") if r.candidate_time else None
        if claim is not None:
            text += f"; speed vs eager: {claim.label}: {claim.sentence}"
        elif r.speedup_eager is not None:
            text += f"; speedup vs eager {fmt_x(r.speedup_eager)}"
        lines.append(text)
    if r.compile_time:
        text = f"torch.compile: median {fmt_ms(r.compile_time.median_ms)}"
        claim = speed_claim(r, "compile") if r.candidate_time else None
        if claim is not None:
            text += f"; speed vs torch.compile: {claim.label}: {claim.sentence}"
        elif r.speedup_compile is not None:
            text += f"; speedup vs torch.compile {fmt_x(r.speedup_compile)}"
        lines.append(text)
    if r.floor_ms is not None:
        text = f"roofline floor: {fmt_ms(r.floor_ms)}"
        if r.floor_fraction is not None:
            text += f" ({fmt_pct(r.floor_fraction)} of the candidate's runtime)"
        lines.append(text)
    for name, unit in (("floor_flops", "FLOP"), ("floor_bytes", "bytes")):
        v = getattr(r, name, None)
        if v:
            lines.append(f"{name}: {fmt_num(v)} {unit}")
    if r.custom_calls_per_forward is not None:
        lines.append(f"calls into its own extension per forward: {int_or_sig(r.custom_calls_per_forward)}")
    for f in r.flags:
        lines.append(f"flag {f.kind.value}: {code_span(f.reason, 300)}")
    if r.profile:
        rows = [k for k in r.profile if not is_annotation(k, r.profile)]
        shown = sorted(rows, key=lambda k: -k.share)[:max_kernels]
        lines.append("profile (share of its time): " + ", ".join(
            f"`{short_kernel_name(k.name)}`{' [own]' if k.own else ''} {fmt_pct(k.share)}" for k in shown)
            + (f", and {len(rows) - len(shown)} more" if len(rows) > len(shown) else ""))
    return lines


def reference_profile_lines(attempts: list[AttemptView], max_kernels: int = 8) -> list[str]:
    for a in attempts:
        if a.result is not None and a.result.reference_profile:
            ks = sorted(a.result.reference_profile, key=lambda k: -k.share)[:max_kernels]
            return [f"`{short_kernel_name(k.name)}` {fmt_pct(k.share)}" for k in ks]
    return []
