"""Why an attempt is incorrect: wrong shapes or dtypes, non-finite values, where the values differ."""
from __future__ import annotations

from agent.critic.diagnosis import (
    Diagnosis,
    TaskContext,
    code_span,
    evidence_ref,
    first_line,
    fmt_err,
)
from agent.critic.failures import fixed_array_note
from agent.critic.numbers import fmt_num, fmt_pct
from agent.critic.patterns import classify
from agent.critic.source import (
    computes_normalisation_stats,
    has_cross_thread_reduction,
    native_blocks,
    unstable_exp_sums,
)
from agent.types import AttemptView, Finding
from sandbox.result import EvalResult


def explain_incorrect(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    trials = r.trials
    failed = [t for t in trials if not t.passed]
    evidence = [evidence_ref(a, "status", r.status.value)]
    if trials:
        head = f"{len(failed)} of {len(trials)} trials failed"
        if failed and len(failed) < len(trials):
            head += (" (the others passed: the failure depends on the inputs or varies from run to run, "
                     "as races and uninitialised memory do)")
    else:
        head = "the outputs did not match the reference"
    first = failed[0] if failed else None
    categories: list[str] = []
    shorts: list[str] = []
    if first is None:
        reason = (trials[0].reason if trials else None) or first_line(r.error_message)
        d.add("incorrect", f"Incorrect: {head}" + (f"; {code_span(reason)}" if reason else "") + ".", evidence)
        d.short = "incorrect"
        return
    evidence.append(evidence_ref(a, f"trials[{first.index}].reason", first.reason))
    for o in first.outputs:
        where = f"trials[{first.index}].outputs[{o.index}]"
        oname = f"output {o.index}" if len(first.outputs) > 1 else "the output"
        if list(o.shape) != list(o.ref_shape):
            d.add("wrong_shape",
                  f"Wrong shape: {oname} has shape {list(o.shape)} where the reference's is {list(o.ref_shape)}.",
                  evidence + [evidence_ref(a, f"{where}.shape", o.shape),
                              evidence_ref(a, f"{where}.ref_shape", o.ref_shape)],
                  {"shape": list(o.shape), "ref_shape": list(o.ref_shape)})
            d.step(1, f"shape:{o.ref_shape}", f"return {oname} with the reference's shape {list(o.ref_shape)} "
                                              f"(check reductions' `keepdim` and final views).")
            categories.append("wrong_shape")
            shorts.append("wrong shape")
            continue
        if o.dtype != o.ref_dtype:
            d.add("wrong_dtype", f"Wrong dtype: {oname} is `{o.dtype}` where the reference's is `{o.ref_dtype}`.",
                  evidence + [evidence_ref(a, f"{where}.dtype", o.dtype),
                              evidence_ref(a, f"{where}.ref_dtype", o.ref_dtype)],
                  {"dtype": o.dtype, "ref_dtype": o.ref_dtype})
            d.step(1, f"dtype:{o.ref_dtype}", f"return `{o.ref_dtype}` like the reference.")
            categories.append("wrong_dtype")
            shorts.append("wrong dtype")
        if o.nan_count or o.inf_count:
            parts = []
            if o.nan_count:
                parts.append(f"{o.nan_count} NaN")
            if o.inf_count:
                parts.append(f"{o.inf_count} Inf")
            frac = (o.nan_count + o.inf_count) / o.numel if o.numel else None
            cause = (f"Non-finite outputs: {oname} holds {' and '.join(parts)} values where the reference is "
                     f"finite" + (f" ({fmt_pct(frac)} of its {o.numel} elements)" if frac is not None else "") + ".")
            unstable = unstable_exp_sums(a.source)
            if unstable:
                u = unstable[0]
                cause = cause[:-1] + (f"; consistent with overflow in `{u.function}`, which sums exp(x) without "
                                      f"subtracting the maximum first (line {u.line}): exp of a large input is "
                                      f"Inf in float32, and so is the log of the sum.")
            d.add("nan_inf", cause,
                  evidence + [evidence_ref(a, f"{where}.nan_count", o.nan_count),
                              evidence_ref(a, f"{where}.inf_count", o.inf_count)],
                  {"nan_count": o.nan_count, "inf_count": o.inf_count, "numel": o.numel})
            if unstable:
                u = unstable[0]
                d.add("overflow",
                      f"`{u.function}` (line {u.line}) exponentiates without subtracting the maximum "
                      f"({code_span(u.statement)}), and these inputs are large enough to overflow it.",
                      [f"attempt {a.attempt_id}: source line {u.line}"], {})
                d.step(1, f"max:{u.function}", f"subtract the row maximum before exponentiating in `{u.function}` "
                                               f"(`m = max(x)`, `lse = m + log(sum(exp(x - m)))`).")
                shorts.append("Inf/NaN: exp overflow (no max subtraction)")
            else:
                d.step(2, "nonfinite", "find where Inf/NaN arise (exp of large values, division by zero, a "
                                       "variance below zero before `rsqrt`, or reads of uninitialised memory).")
                shorts.append("Inf/NaN outputs")
            categories.append("nan_inf")
        if o.mismatched:
            pct = fmt_pct(o.mismatched / o.numel) if o.numel else None
            pattern = o.mismatch_pattern
            where_words = {
                "everywhere": "everywhere",
                "some_rows": "only in some rows" + (f" (first: {', '.join(str(x) for x in o.bad_rows[:5])})"
                                                  if o.bad_rows else ""),
                "tile_edges": "at tile edges",
                "scattered": "at scattered elements",
            }.get(pattern or "", None)
            amount = (f"{o.mismatched} of {o.numel} elements" + (f" ({pct})" if pct else "") +
                      f" are outside the tolerance (atol {fmt_num(o.tolerance.atol)}, "
                      f"rtol {fmt_num(o.tolerance.rtol)})")
            errs = []
            if o.max_abs_err is not None:
                errs.append(f"max abs error {fmt_err(o.max_abs_err)}")
            if o.max_rel_err is not None:
                errs.append(f"max rel error {fmt_err(o.max_rel_err)}")
            patterns = classify(o.locations, o.numel)
            if patterns:
                where_words = None
            cause = (f"Wrong values{(' ' + where_words) if where_words else ''}: in {oname} {amount}"
                     + (f"; {', '.join(errs)}" if errs else "") + ".")
            if patterns:
                cause += " Error pattern: " + "; ".join(p.sentence for p in patterns) + "."
            meaning = {
                "everywhere": " Errors everywhere point at the computation itself (the formula, the statistics "
                              "or the indexing), not at boundary handling.",
                "some_rows": " Errors confined to some rows point at work that does not cover every row or "
                             "feature alike (a fixed-size buffer, a grid that misses rows, a per-row bound).",
                "tile_edges": " Errors at tile edges point at boundary handling where a size is not a multiple "
                              "of the tile or block size.",
                "scattered": " Scattered errors point at a race (missing synchronisation), uninitialised memory "
                             "or reduced precision.",
            }.get(pattern or "", "")
            if patterns:
                lead = next((p for p in patterns if p.kind != "nonfinite"), patterns[0])
                meaning = f" Such a pattern usually means {lead.meaning}."
            if any(f.category == "overflow" for f in d.findings):
                meaning = " The non-finite values above account for these."
            small = (o.max_abs_err is not None and o.max_abs_err <= 10 * o.tolerance.atol and
                     o.nan_count == 0 and o.inf_count == 0)
            if small:
                meaning += (" The errors are small (within ten times atol): summation order or reduced precision "
                            "rather than a wrong formula.")
            numbers = {"mismatched": o.mismatched, "numel": o.numel, "atol": o.tolerance.atol,
                       "rtol": o.tolerance.rtol}
            if o.max_abs_err is not None:
                numbers["max_abs_err"] = o.max_abs_err
            if o.max_rel_err is not None:
                numbers["max_rel_err"] = o.max_rel_err
            if pattern:
                numbers["mismatch_pattern"] = pattern
            d.add("mismatch", cause + meaning,
                  evidence + [evidence_ref(a, f"{where}.mismatched", o.mismatched),
                              evidence_ref(a, f"{where}.max_abs_err", o.max_abs_err),
                              evidence_ref(a, f"{where}.mismatch_pattern", pattern)], numbers)
            for p in patterns:
                d.findings.append(Finding(attempt_id=a.attempt_id, category=f"pattern_{p.kind}", cause=p.sentence,
                                          evidence=[evidence_ref(a, f"{where}.locations", p.kind)],
                                          numbers=dict(p.numbers)))
            categories.append("mismatch")
            if patterns:
                shorts.append("wrong values (" + ", ".join(dict.fromkeys(p.kind.replace("_", " ") for p in patterns))
                              + ")")
            else:
                shorts.append(f"wrong values ({pattern.replace('_', ' ')})" if pattern else "wrong values")
    d.bullets.insert(0, f"Incorrect: {head}.")
    if "mismatch" in categories or "nan_inf" in categories:
        explained = fixed_array_note(a, d, ctx, failing=True)
        if explained:
            shorts.append("fixed-size array")
        if ctx.group_norm and "mismatch" in categories and _group_stats_note(a, d, first):
            shorts.append("group statistics")
    if not categories:
        reason = first.reason or "the outputs did not match"
        d.add("incorrect", f"Incorrect: {code_span(reason)}.", evidence)
        shorts.append("incorrect")
    d.short = "; ".join(dict.fromkeys(shorts))


def _group_stats_note(a: AttemptView, d: Diagnosis, trial) -> bool:
    """GroupNorm computed by the candidate itself, and the outputs wrong throughout."""
    if not computes_normalisation_stats(a.source):
        return False
    patterns = {o.mismatch_pattern for o in trial.outputs if o.mismatched}
    if patterns and not patterns & {"everywhere", None}:
        return False
    if not has_cross_thread_reduction(a.source) and any(b.lang == "cuda" for b in native_blocks(a.source)):
        how = ("its kernels compute a mean and variance but never combine values across threads "
               "(no shared memory, barrier, atomic or warp shuffle): each thread's statistics cover only "
               "its own elements, not the whole group")
    else:
        how = ("the candidate computes the mean and variance itself and every output is wrong, which is what "
               "statistics reduced over the wrong set of elements produce (per element, per thread or per "
               "channel instead of per group)")
    d.add("group_stats",
          f"Group normalisation statistics: {how}. GroupNorm needs one mean and one variance per (sample, group), "
          f"over all channels of the group and all their positions.",
          [f"attempt {a.attempt_id}: source computes mean/variance; task uses GroupNorm"])
    d.step(1, "group_stats", "compute the group statistics per group: for each sample and group, reduce the sum "
                             "and the sum of squares over all channels of the group and all positions (a block "
                             "per group, with a block-wide reduction), then normalise every element with that "
                             "group's mean and variance.")
    return True
