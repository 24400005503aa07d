"""Causes of attempts that did not run to a verdict on values: no candidate, compile, load and
runtime errors, timeouts; the harness's flags; latent overflow and fixed-size arrays in the source."""
from __future__ import annotations

import re
from typing import Any

from agent.critic.diagnosis import (
    Diagnosis,
    TaskContext,
    code_span,
    evidence_ref,
    first_line,
)
from agent.critic.numbers import fmt_s
from agent.critic.source import (
    fixed_arrays,
    pytorch_calls_in_forward,
    source_line,
    unstable_exp_sums,
)
from agent.types import AttemptView
from sandbox.result import EvalResult, FlagKind

PARSE_CAUSES = {
    "no_code": ("no_code", "empty answer: the response holds no code, so nothing was built or run",
                "answer with one complete Python module (a single code block) that defines `ModelNew`."),
    "no_model_new": ("no_model_new", "the code defines no `ModelNew` class, so there is nothing to evaluate",
                     "define the optimised model as `class ModelNew(nn.Module)` with the reference's "
                     "`__init__` arguments."),
    "truncated": ("truncated", "the response was cut off before the code ended (truncated), so it was not evaluated",
                  "give a shorter answer: one module, no commentary, so it is not cut off."),
    "syntax_error": ("syntax_error", "the code is not valid Python, so it was not evaluated",
                     "fix the Python syntax error before anything else."),
}

# (pattern in the error text, kind, what it means, what to change)
RUNTIME_KINDS: list[tuple[str, str, str, str]] = [
    (r"illegal memory access", "illegal memory access",
     "a kernel read or wrote outside the memory it owns (an index past the end of a tensor)",
     "Check every index against the tensor sizes: guard each thread with `if (idx < n)` and "
     "derive row and column bounds from the input's shape, not from constants."),
    (r"misaligned address", "misaligned address",
     "a vector load or store (float4, half2, ...) used an address not aligned to its width",
     "Use vector loads only on aligned, contiguous data whose length is a multiple of the width "
     "(fall back to scalar loads for the remainder)."),
    (r"out of memory", "out of memory",
     "an allocation failed: the device (or the worker's memory limit) ran out of memory",
     "Allocate less: reuse buffers, avoid materialising large intermediates."),
    (r"unspecified launch failure", "unspecified launch failure",
     "a kernel crashed (typically an out-of-bounds access or an infinite loop hitting the watchdog)",
     "Check the kernel's indexing and loop bounds."),
    (r"invalid configuration argument", "invalid launch configuration",
     "the launch configuration was rejected (more than 1024 threads per block, an empty grid, "
     "or more shared memory than allowed)",
     "Launch at most 1024 threads per block and a non-empty grid computed from the input's size."),
    (r"too many resources requested", "too many resources requested for launch",
     "the kernel needs more registers or shared memory per block than the device provides",
     "Use fewer threads per block or less shared memory per block."),
    (r"device-side assert", "device-side assert",
     "an assertion inside a kernel failed (often an index out of range)",
     "Check the indices the asserting kernel uses."),
    (r"no kernel image is available|invalid device function", "no kernel image for this GPU",
     "the extension was not compiled for this GPU's architecture",
     "Do not hard-code `-arch` flags; let PyTorch pick the architecture."),
    (r"illegal instruction", "illegal instruction",
     "a kernel executed an invalid instruction (often a corrupted stack or a bad function pointer)",
     "Check the kernel's indexing and recursion."),
    (r"stack smashing", "stack smashing",
     "a write past the end of a fixed-size array on the stack",
     "Size arrays from the input's dimensions (or loop in chunks) instead of a fixed length."),
    (r"segmentation fault|sigsegv|signal 11", "segmentation fault",
     "the process read or wrote invalid memory",
     "Check every index and pointer against the tensor sizes (and that tensors are contiguous)."),
    (r"sigabrt|aborted|signal 6", "abort",
     "the process aborted (a failed check or a corrupted heap or stack)",
     "Check indices and array sizes."),
    (r"must match the size|size mismatch|shape .* is invalid|mat1 and mat2 shapes", "shape error",
     "an operation received tensors of incompatible shapes",
     "Check the shapes passed between ops and kernels against the reference's."),
    (r"expected all tensors to be on the same device|on the same device", "device mismatch",
     "tensors on different devices met in one operation",
     "Create every buffer on the input's device (`torch.empty_like(x)` or `device=x.device`)."),
    (r"expected .* to be contiguous|is not contiguous|non-contiguous", "non-contiguous input",
     "a kernel required contiguous memory and got a strided tensor",
     "Call `.contiguous()` on inputs before taking their data pointer."),
]

_UNDECLARED = re.compile(
    r"[‘'`\"](?P<a>[A-Za-z_]\w*)[’'`\"] was not declared in this scope|"
    r"identifier [\"'](?P<b>[A-Za-z_]\w*)[\"'] is undefined|"
    r"use of undeclared identifier [‘'`\"](?P<c>[A-Za-z_]\w*)[’'`\"]")


def explain_unparsed(a: AttemptView, ctx: TaskContext) -> Diagnosis:
    status = a.parse_status
    if status == "ok":
        d = Diagnosis(a, "not evaluated", "not evaluated")
        d.add("not_evaluated", "the answer parsed but has no stored evaluation")
        return d
    category, cause, step = PARSE_CAUSES.get(status, (
        "parse_error", "the answer could not be turned into a candidate, so it was not evaluated",
        "answer with one complete Python module that defines `ModelNew`."))
    if status == "no_code" and (a.source or "").strip():
        cause = "the response holds no code block, so nothing was built or run"
    if a.parse_error:
        cause += f" ({code_span(a.parse_error)})"
    d = Diagnosis(a, "no candidate", {"no_code": "empty answer", "no_model_new": "no ModelNew",
                                      "truncated": "truncated answer", "syntax_error": "Python syntax error"}
                  .get(status, "unusable answer"))
    d.add(category, cause[0].upper() + cause[1:] + ".", [f"attempt {a.attempt_id}: parse_status={status!r}"])
    d.step(3, f"parse:{status}", step)
    return d


def explain_compile_error(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    b = r.build
    first = b.first_error if b else None
    line = b.first_error_line if b else None
    if not first and b and b.log:
        first = next((ln.strip() for ln in b.log.splitlines() if re.search(r"\berror\b", ln, re.I)), None)
    where = f" at line {line}" if line else ""
    cause = f"The build failed{where}; the first compiler error is {code_span(first)}."
    numbers: dict[str, Any] = {}
    evidence = [evidence_ref(a, "status", r.status.value)]
    if line:
        numbers["first_error_line"] = line
        evidence.append(evidence_ref(a, "build.first_error_line", line))
    if first:
        evidence.append(evidence_ref(a, "build.first_error", first))
    extra = []
    m = _UNDECLARED.search(first or "") or _UNDECLARED.search(b.log if b else "")
    var = (m.group("a") or m.group("b") or m.group("c")) if m else None
    if var:
        extra.append(f"`{var}` is used where it was never declared (an undeclared variable, "
                     f"e.g. a loop index whose declaration is missing)")
    text_line = source_line(a.source, line)
    if text_line:
        extra.append(f"line {line} of the candidate reads {code_span(text_line)}")
    if extra:
        cause = cause[:-1] + ": " + "; ".join(extra) + "."
    d.add("compile_error", cause, evidence, numbers)
    step = f"fix the first compile error{where}"
    if var:
        step += f": declare `{var}` before it is used (e.g. `for (int {var} = 0; ...)`)"
    elif first:
        step += f" ({code_span(first, 120)})"
    d.step(1, f"compile:{line}:{first}", step + "; a kernel that does not build cannot be checked.")
    d.short = f"compile error{where}" + (f" (undeclared `{var}`)" if var else "")


def explain_load_error(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    msg = first_line(r.error_message)
    evidence = [evidence_ref(a, "status", r.status.value)]
    if r.error_type:
        evidence.append(evidence_ref(a, "error_type", r.error_type))
    cause = f"The extension built but loading the candidate failed: {code_span((r.error_type or '') + ': ' + msg)}."
    sym = re.search(r"undefined symbol:?\s*(\S+)", r.error_message or "")
    if sym:
        cause = cause[:-1] + (f"; the undefined symbol {code_span(sym.group(1))} is a function that is declared "
                              f"(and bound to Python) but never defined.")
        d.step(1, f"symbol:{sym.group(1)}", f"define every function the bindings declare "
                                            f"(undefined symbol {code_span(sym.group(1), 80)}).")
    elif re.search(r"ModelNew", r.error_message or ""):
        d.step(1, "load:modelnew", "make the module define `ModelNew` at top level and import cleanly.")
    else:
        d.step(2, f"load:{msg}", f"make the module load: {code_span(msg, 120)}.")
    d.add("load_error", cause, evidence)
    d.short = "load error" + (" (undefined symbol)" if sym else "")


def explain_runtime_error(a: AttemptView, r: EvalResult, d: Diagnosis, ctx: TaskContext) -> None:
    text = " ".join(filter(None, [r.error_type, r.error_message, r.stderr[-4000:] if r.stderr else ""]))
    kind = None
    for pattern, name, meaning, step in RUNTIME_KINDS:
        if re.search(pattern, text, re.IGNORECASE):
            kind = (name, meaning, step)
            break
    msg = first_line(r.error_message) or (r.error_type or "")
    evidence = [evidence_ref(a, "status", r.status.value)]
    if r.error_type:
        evidence.append(evidence_ref(a, "error_type", r.error_type))
    if kind:
        cause = f"Runtime error, {kind[0]}: {kind[1]} ({code_span(msg)})."
        d.add("runtime_error", cause, evidence, {"error_kind": kind[0]})
        d.step(2, f"runtime:{kind[0]}", f"({kind[0]}) {kind[2]}")
        d.short = f"runtime error: {kind[0]}"
    else:
        cause = f"Runtime error while running the candidate: {code_span((r.error_type or '') + ': ' + msg)}."
        d.add("runtime_error", cause, evidence)
        d.step(2, f"runtime:{msg}", f"fix the runtime error ({code_span(msg, 120)}).")
        d.short = "runtime error"
    if kind and kind[0] in ("illegal memory access", "unspecified launch failure", "segmentation fault",
                            "stack smashing", "abort"):
        fixed_array_note(a, d, ctx, failing=True)


def explain_timeout(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    in_build = r.build is None or not r.build.ok
    evidence = [evidence_ref(a, "status", r.status.value)]
    msg = first_line(r.error_message)
    if in_build:
        limit = r.config.build_timeout_s
        cause = f"Timed out while building: the build did not finish within the {fmt_s(limit)} build limit."
        numbers = {"build_timeout_s": limit}
        d.step(2, "timeout:build", "the build did not finish in time: keep the extension small "
                                   "(no large template instantiations or unrolled loops).")
    else:
        limit = r.config.run_timeout_s
        cause = (f"Timed out while running: checking and timing did not finish within the {fmt_s(limit)} "
                 f"run limit (a kernel that never ends, e.g. a loop whose index never advances, or a deadlock "
                 f"at a barrier only some threads reach, or work far slower than the reference).")
        numbers = {"run_timeout_s": limit}
        d.step(2, "timeout:run", "timed out: check that every loop advances and that every thread of a "
                                 "block reaches each `__syncthreads()`.")
    if msg:
        cause = cause[:-1] + f" ({code_span(msg)})."
    d.add("timeout", cause, evidence, numbers)
    d.short = "timeout (build)" if in_build else "timeout (run)"


def fixed_array_note(a: AttemptView, d: Diagnosis, ctx: TaskContext, failing: bool) -> bool:
    """A fixed-size array smaller than one of the task's dimensions, in a failing attempt."""
    arrays = fixed_arrays(a.source)
    dims = {k: v for k, v in ctx.constants.items() if "batch" not in k.lower()}
    for arr in arrays:
        if arr.strided:
            continue    # a buffer of partial results, the data itself covered by strided loops
        bigger = sorted((k for k, v in dims.items() if v > arr.size), key=lambda k: -dims[k])
        if not bigger:
            continue
        names = ", ".join(f"`{k}` = {dims[k]}" for k in bigger[:3])
        kind = "shared-memory" if arr.shared else "fixed-size"
        cause = (f"Static inspection: line {arr.line} declares a {kind} array `{arr.name}[{arr.size}]` "
                 f"holding a fixed {arr.size} entries while the task has {names}; if it is meant to hold "
                 f"one entry per element of that dimension, it covers only the first {arr.size} of them "
                 f"(or is written past its end).")
        d.add("fixed_size_array", cause, [f"attempt {a.attempt_id}: source line {arr.line}"],
              {"array_size": arr.size, **{k: dims[k] for k in bigger[:3]}})
        d.step(2, f"array:{arr.name}:{arr.size}", f"size `{arr.name}` from the actual dimension (dynamic shared "
                                                 f"memory, or loop over the dimension in chunks of {arr.size}) "
                                                 f"instead of a fixed {arr.size} entries.")
        return True
    return False



def latent_overflow(a: AttemptView, d: Diagnosis, passed: bool = True) -> None:
    unstable = unstable_exp_sums(a.source)
    if not unstable:
        return
    u = unstable[0]
    if passed:
        cause = (f"Latent overflow risk: `{u.function}` (line {u.line}) sums exp(x) without subtracting the "
                 f"maximum ({code_span(u.statement)}). It passed because these inputs stay small enough; inputs "
                 f"large enough to overflow exp in float32 would make it return Inf where the reference is "
                 f"finite.")
        step = (f"correct only because these inputs are small: subtract the row maximum before exp in "
                f"`{u.function}` (`lse = m + log(sum(exp(x - m)))`) so large inputs cannot overflow.")
    else:
        cause = (f"Also a latent overflow risk: `{u.function}` (line {u.line}) sums exp(x) without subtracting "
                 f"the maximum ({code_span(u.statement)}); it did not cause this failure (no Inf or NaN was "
                 f"reported), but large inputs would overflow it.")
        step = f"also subtract the row maximum before exp in `{u.function}`."
    d.add("latent_overflow", cause, [f"attempt {a.attempt_id}: source line {u.line}"], {})
    d.step(2, f"max:{u.function}", step)



def merged_flags(r: EvalResult) -> list[Any]:
    """One flag per kind, the reasons of repeated kinds joined."""
    from sandbox.result import Flag

    merged: dict[Any, list[str]] = {}
    for f in r.flags:
        reasons = merged.setdefault(f.kind, [])
        if f.reason not in reasons:
            reasons.append(f.reason)
    return [Flag(kind=k, reason="; ".join(v)) for k, v in merged.items()]


def flag_causes(a: AttemptView, r: EvalResult, d: Diagnosis) -> None:
    for f in merged_flags(r):
        kind = f.kind.value
        evidence = [evidence_ref(a, "flags", kind)]
        if f.kind is FlagKind.no_custom_kernel:
            calls = pytorch_calls_in_forward(a.source)
            extra = f" Its forward calls {', '.join(f'`{c}`' for c in calls[:5])}." if calls else ""
            cause = (f"Flagged no custom kernel: no kernel of the candidate's own ran "
                     f"({code_span(f.reason)}); it is a PyTorch rewrite, so its timing says nothing about custom "
                     f"kernels and it does not count as an optimised solution." + extra)
            d.step(2, "no_custom_kernel", "a PyTorch rewrite: write the fused operation as a kernel of "
                                          "its own (load_inline) and call it from `forward`.")
            d.short = (d.short + "; " if d.short else "") + "no custom kernel"
        elif f.kind is FlagKind.fallback:
            cause = (f"Flagged fallback: the candidate has a path back to PyTorch ({code_span(f.reason)}); its verdict "
                     f"may describe the fallback rather than its kernel.")
            d.step(2, "fallback", "remove the fallback path (try/except around the kernel, or the reference "
                                  "Model); let failures show.")
            d.short += "; fallback"
        elif f.kind is FlagKind.precision:
            cause = f"Flagged precision: its source asks for a narrower format ({code_span(f.reason)})."
            if r.fp64_measured and not r.has_flag(FlagKind.inaccurate):
                cause += (" The float64 check measured it no less accurate than the float32 reference, so "
                          "the note does not disqualify it.")
            d.short += "; precision note"
        elif f.kind is FlagKind.inaccurate:
            cause = (f"Flagged inaccurate: within tolerance, but measurably less accurate than the float32 "
                     f"reference ({code_span(f.reason)}); it does not count as a correct kernel.")
            d.step(2, "inaccurate", "keep float32 accuracy: no narrower storage or compute format (half, bf16, "
                                    "uncompensated TF32) for values that reach the output.")
            d.short += "; inaccurate"
        elif f.kind is FlagKind.suspicious:
            cause = f"Flagged suspicious: {code_span(f.reason)}; its verdict and timing are not to be trusted."
            if r.stray_processes_killed:
                cause += (f" It left {r.stray_processes_killed} process(es) running after its code returned; "
                          f"the sandbox killed them.")
            d.step(2, "suspicious", f"flagged suspicious ({code_span(f.reason, 160)}): do all of the work inside "
                                    f"`forward`, on the timed stream, with nothing left running or patched "
                                    f"afterwards, so the harness can trust the timing.")
            d.short += "; suspicious"
        elif f.kind is FlagKind.impossible:
            cause = (f"Flagged impossible: faster than the roofline floor allows ({code_span(f.reason)}); the timing "
                     f"cannot be right (work skipped, cached or done outside the timed region).")
            d.step(2, "impossible", "faster than the roofline floor allows: compute every output on every call "
                                    "(no caching across calls, no skipped work).")
            d.short += "; impossible timing"
        elif f.kind is FlagKind.contended:
            cause = (f"Flagged contended: the device was not quiet while it was timed ({code_span(f.reason)}); "
                     f"its timing, and any speedup, are not to be trusted.")
            d.step(2, "contended", "the timing was disturbed; if the candidate started nothing that runs beside "
                                   "the harness, evaluate it again on a quiet device.")
            d.short += "; contended timing"
        elif f.kind is FlagKind.inputs_mutated:
            cause = (f"Flagged inputs mutated: the candidate changed its input tensors in place "
                     f"({code_span(f.reason)}); the caller's data is not preserved.")
            d.step(2, "inputs_mutated", "write results to a new tensor; never modify the inputs in place.")
            d.short += "; inputs mutated"
        else:
            cause = f"Flagged {kind}: {code_span(f.reason)}."
        d.add(kind, cause, evidence)
