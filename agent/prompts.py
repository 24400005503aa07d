"""Rendering the prompts under ``prompts/`` into chat messages.

One jinja2 file per prompt (``StrictUndefined``: a missing variable is an error, never an
empty string). ``render`` gives a system message (``system.j2``) and a user message (the
named template) and the sha256 of the messages as sent; each model call records the
template name and that hash. ``build_proposal_messages`` is the loop's entry point: the
first-round prompt when there is no earlier attempt, else the refinement prompt with the
fastest correct attempt and the most instructive distinct failures, each with its
evidence (compiler error and line, mismatch figures, runtimes against eager,
torch.compile and the roofline floor, flags), and the critic's latest analysis.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any, Optional

import jinja2

from agent.critic.patterns import classify
from agent.types import AttemptView, DeviceFacts
from sandbox.numerics import Numerics
from sandbox.result import DISQUALIFYING_FLAGS, EvalResult, Status
from sandbox.tasks import TaskSpec

FIRST = "propose_first"
REFINE = "propose_refine"
SYSTEM = "system"

MAX_SOURCE_CHARS = 8000        # the best attempt's source; other attempts get half
MAX_ANALYSIS_CHARS = 6000
MAX_MESSAGE_CHARS = 600        # an error message or log excerpt quoted as evidence

# Failures that got further tell more; used to order failures of the same round.
_DEPTH = {"flagged": 0, Status.incorrect.value: 1, Status.runtime_error.value: 2, Status.timeout.value: 3,
          Status.load_error.value: 4, Status.compile_error.value: 5, "parse": 6}
# (stray processes a candidate left running are `suspicious`; `contended`: its timing was disturbed)
_DOUBTFUL = DISQUALIFYING_FLAGS


# ---------------------------------------------------------------- rendering

def _ms(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if value >= 100:
        return f"{value:.0f} ms"
    if value >= 1:
        return f"{value:.3g} ms"
    return f"{value:.3g} ms ({value * 1000:.3g} us)"


@lru_cache(maxsize=None)
def _environment(root: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(root), undefined=jinja2.StrictUndefined,
                             autoescape=False, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["ms"] = _ms
    env.filters["pyrepr"] = repr
    env.filters["tflops"] = lambda d: ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in sorted(d.items()))
    return env


def environment() -> jinja2.Environment:
    from kernelloop.paths import prompts_dir

    return _environment(str(prompts_dir()))


def _file(name: str) -> str:
    return name if name.endswith(".j2") else f"{name}.j2"


def render_text(template_name: str, **ctx: Any) -> str:
    """One template as text; ``template_name`` with or without ``.j2``."""
    text = environment().get_template(_file(template_name)).render(**ctx)
    return _tidy(text)


def _tidy(text: str) -> str:
    """Collapse runs of blank lines that conditional sections leave; strip the ends."""
    out: list[str] = []
    blank = 0
    in_code = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if not line.strip() and not in_code:
            blank += 1
            if blank > 1:
                continue
        else:
            blank = 0
        out.append(line.rstrip() if not in_code else line)
    return "\n".join(out).strip() + "\n"


def messages_sha256(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def render(template_name: str, system_template: Optional[str] = SYSTEM,
           **ctx: Any) -> tuple[list[dict[str, str]], str]:
    """``[system, user]`` messages (no system message when ``system_template`` is None) and their sha256."""
    ctx.setdefault("left_out", [])          # what was left out to fit the window (fit_proposal_messages)
    ctx.setdefault("include_example", True)
    if "device" in ctx:                     # what kernels are written in: the device's load_inline backend unless told
        ctx.setdefault("backend", getattr(ctx["device"], "device", None))
    messages: list[dict[str, str]] = []
    if system_template:
        messages.append({"role": "system", "content": render_text(system_template, **ctx)})
    messages.append({"role": "user", "content": render_text(template_name, **ctx)})
    return messages, messages_sha256(messages)


# ---------------------------------------------------------------- evidence

def cap_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    return text[: limit - 20].rstrip() + f" ... [{len(text) - limit + 20} chars cut]"


def cap_source(source: str, max_chars: int, focus_line: Optional[int] = None) -> str:
    """``source`` cut to about ``max_chars``: its head and tail, and the lines around
    ``focus_line`` (1-based; a compiler error's line) when given; gaps are marked."""
    if len(source) <= max_chars:
        return source
    lines = source.splitlines()
    keep: set[int] = set()
    used = 0

    def take(i: int) -> bool:
        nonlocal used
        if i in keep or not 0 <= i < len(lines):
            return True
        cost = len(lines[i]) + 1
        if used + cost > max_chars:
            return False
        keep.add(i)
        used += cost
        return True

    if focus_line:
        f = focus_line - 1
        for i in sorted(range(f - 12, f + 8), key=lambda i: abs(i - f)):
            take(i)
    head, tail = 0, len(lines) - 1
    while head <= tail:
        if not take(head):
            break
        head += 1
        if head <= tail and not take(tail):
            break
        tail -= 1
    out: list[str] = []
    gap = 0
    for i, line in enumerate(lines):
        if i in keep:
            if gap:
                out.append(f"# ... [{gap} lines omitted] ...")
                gap = 0
            out.append(line)
        else:
            gap += 1
    if gap:
        out.append(f"# ... [{gap} lines omitted] ...")
    return "\n".join(out) + "\n"


def _g(x: Optional[float], fmt: str = ".3g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _doubtful(result: EvalResult) -> list[str]:
    return sorted(f.kind.value for f in result.flags if f.kind in _DOUBTFUL)


def failure_kind(a: AttemptView) -> str:
    """parse | compile_error | load_error | runtime_error | timeout | incorrect | flagged | correct."""
    if a.result is None:
        return "parse"
    if a.result.correct:
        return "flagged" if _doubtful(a.result) else "correct"
    return a.result.status.value


def _signature(a: AttemptView) -> tuple:
    kind = failure_kind(a)
    r = a.result
    if r is None:
        return (kind, a.parse_status)
    if kind == "flagged":
        return (kind, tuple(_doubtful(r)))
    if kind == Status.compile_error.value:
        first = (r.build.first_error if r.build else None) or r.error_message or ""
        return (kind, first.strip()[:100])
    if kind in (Status.load_error.value, Status.runtime_error.value):
        return (kind, r.error_type, (r.error_message or "").strip().split("\n")[0][:100])
    if kind == Status.incorrect.value:
        trial = r.first_failed_trial()
        bad = [o for o in (trial.outputs if trial else []) if o.mismatched or o.nan_count or o.inf_count
               or o.shape != o.ref_shape]
        o = bad[0] if bad else None
        if o is None:
            return (kind, trial.reason if trial else None)
        what = "shape" if o.shape != o.ref_shape else "nonfinite" if (o.nan_count or o.inf_count) else o.mismatch_pattern
        return (kind, what)
    return (kind,)


def headline(a: AttemptView) -> str:
    r = a.result
    if r is None:
        return f"No usable code: {a.parse_status}."
    kind = failure_kind(a)
    if kind in ("correct", "flagged"):
        t = r.candidate_time.median_ms if r.candidate_time else None
        parts = [f"Correct, {_ms(t)}"]
        if r.speedup_eager is not None:
            parts.append(f"{r.speedup_eager:.2f}x eager")
        if r.speedup_compile is not None:
            parts.append(f"{r.speedup_compile:.2f}x torch.compile")
        text = ", ".join(parts) + "."
        if kind == "flagged":
            text += f" Flagged ({', '.join(_doubtful(r))}): it does not count."
        return text
    return {Status.compile_error.value: "Build failed.", Status.load_error.value: "Built, but failed to load.",
            Status.runtime_error.value: "Crashed while running.", Status.timeout.value: "Timed out.",
            Status.incorrect.value: "Ran, but the outputs are wrong.",
            Status.infra_error.value: "Not judged: the harness failed."}[kind]


def evidence(a: AttemptView) -> list[str]:
    """The stored figures behind an attempt's verdict, one line each."""
    r = a.result
    lines: list[str] = []
    if r is None:
        if a.parse_error:
            lines.append(cap_text(a.parse_error))
        if a.parse_status == "truncated":
            lines.append("the answer hit the token limit: write a shorter module (fewer kernels, no commentary)")
        return lines
    if r.status is Status.compile_error:
        b = r.build
        if b and b.first_error:
            where = f" (line {b.first_error_line} of the candidate's source)" if b.first_error_line else ""
            lines.append(f"first compiler error{where}: {cap_text(b.first_error, 400)}")
        elif b and b.log:
            lines.append(f"build log (end): {cap_text(b.log[-MAX_MESSAGE_CHARS:])}")
        elif r.error_message:
            lines.append(cap_text(r.error_message))
    elif r.status in (Status.load_error, Status.runtime_error, Status.timeout):
        if r.error_type or r.error_message:
            lines.append(cap_text(f"{r.error_type or 'error'}: {r.error_message or ''}"))
        if r.traceback:
            tail = " | ".join(line.strip() for line in r.traceback.strip().splitlines()[-4:])
            lines.append(f"traceback (last lines): {cap_text(tail, 400)}")
    elif r.status is Status.incorrect:
        trial = r.first_failed_trial()
        passed = sum(t.passed for t in r.trials)
        if trial is not None:
            lines.append(f"{passed} of {len(r.trials)} trials passed; trial {trial.index} failed"
                         + (f": {cap_text(trial.reason, 300)}" if trial.reason else ""))
            for o in trial.outputs:
                lines.extend(_output_lines(o))
    if r.correct:
        lines.extend(_timing_lines(r))
    if r.stray_processes_killed:
        lines.append(f"it left {r.stray_processes_killed} process(es) running, which the sandbox killed: start no "
                     f"process or thread that outlives forward")
    for f in r.flags:
        lines.append(f"flag {f.kind.value}: {cap_text(f.reason, 300)}")
    return lines


def _output_lines(o) -> list[str]:
    out: list[str] = []
    if o.shape != o.ref_shape or o.dtype != o.ref_dtype:
        out.append(f"output {o.index}: {o.dtype} of shape {o.shape}, expected {o.ref_dtype} of shape {o.ref_shape}")
        return out
    if o.nan_count or o.inf_count:
        out.append(f"output {o.index}: {o.nan_count} NaN and {o.inf_count} Inf where the reference is finite")
    if o.mismatched:
        line = (f"output {o.index}: {o.mismatched} of {o.numel} elements outside tolerance "
                f"(atol {o.tolerance.atol:g}, rtol {o.tolerance.rtol:g}); max abs error {_g(o.max_abs_err)}, "
                f"max rel error {_g(o.max_rel_err)}")
        patterns = [p for p in classify(o.locations, o.numel) if p.kind != "nonfinite"]
        if patterns:
            # the critic's named patterns (indices and sizes that prove them), most specific first
            line += "; " + "; ".join(p.sentence for p in patterns[:2])
        else:
            if o.mismatch_pattern:
                line += f"; pattern: {o.mismatch_pattern}"
            if o.bad_rows:
                line += f" (first bad rows {', '.join(map(str, o.bad_rows[:6]))})"
        out.append(line)
    return out


def _timing_lines(r: EvalResult) -> list[str]:
    lines: list[str] = []
    if r.candidate_time:
        t = r.candidate_time
        parts = [f"runtime {_ms(t.median_ms)} median (IQR {t.iqr_ms:.2g} ms, {t.runs} runs)"]
        if r.eager_time:
            parts.append(f"eager {_ms(r.eager_time.median_ms)}"
                         + (f", speedup {r.speedup_eager:.2f}x" if r.speedup_eager is not None else ""))
        if r.compile_time:
            parts.append(f"torch.compile {_ms(r.compile_time.median_ms)}"
                         + (f", speedup {r.speedup_compile:.2f}x" if r.speedup_compile is not None else ""))
        lines.append("; ".join(parts))
    if r.floor_ms is not None:
        frac = (f": this attempt reaches {r.floor_fraction:.0%} of the roofline (floor / runtime)"
                if r.floor_fraction else "")
        lines.append(f"roofline floor {_ms(r.floor_ms)}{frac}")
    if r.custom_calls_per_forward is not None:
        lines.append(f"calls into the custom kernels per forward: {r.custom_calls_per_forward:g}")
    if r.profile:
        top = sorted(r.profile, key=lambda k: -k.share)[:4]
        lines.append("time by kernel: " + ", ".join(
            f"{k.name[:60]} {k.share:.0%}{' (yours)' if k.own else ''}" for k in top))
    return lines


# ---------------------------------------------------------------- choosing

def choose_attempts(history: list[AttemptView], max_shown: int = 4) -> list[tuple[str, AttemptView]]:
    """(role, attempt) pairs to show: the fastest clean correct attempt ("best"), then distinct
    failures ("failure": one of each kind first, then other distinct causes; newest round
    first and, within a round, those that got furthest), then other correct attempts by speed
    ("correct"). Never the same source text twice."""
    if max_shown <= 0:
        return []
    seen_sources: set[str] = set()

    def fresh(a: AttemptView) -> bool:
        key = a.source or f"#attempt-{a.attempt_id}"
        if key in seen_sources:
            return False
        seen_sources.add(key)
        return True

    def speed(a: AttemptView) -> float:
        r = a.result
        return r.candidate_time.median_ms if r and r.candidate_time else float("inf")

    clean = sorted((a for a in history if failure_kind(a) == "correct"), key=lambda a: (speed(a), a.attempt_id))
    if not clean:
        # correct, its only doubt its timing (``contended``: the machine was disturbed, not the
        # candidate's doing): still the one to improve on, its flag shown with it
        clean = sorted((a for a in history if a.result is not None and a.result.contended_only),
                       key=lambda a: (speed(a), a.attempt_id))
    chosen: list[tuple[str, AttemptView]] = []
    if clean and fresh(clean[0]):
        chosen.append(("best", clean[0]))
    failures = sorted((a for a in history if failure_kind(a) != "correct"),
                      key=lambda a: (-a.round, _DEPTH[failure_kind(a)], -a.attempt_id))
    # First one failure of each kind, then further distinct causes of the same kinds.
    kinds: set[str] = set()
    signatures: set[tuple] = set()
    for first_pass in (True, False):
        for a in failures:
            if len(chosen) >= max_shown:
                break
            sig = _signature(a)
            if sig in signatures or (first_pass and sig[0] in kinds) or not fresh(a):
                continue
            kinds.add(sig[0])
            signatures.add(sig)
            chosen.append(("failure", a))
    for a in clean[1:]:
        if len(chosen) >= max_shown:
            break
        if fresh(a):
            chosen.append(("correct", a))
    return chosen


def _summary(history: list[AttemptView]) -> str:
    counts: dict[str, int] = {}
    for a in history:
        k = failure_kind(a)
        k = a.parse_status if k == "parse" else k
        counts[k] = counts.get(k, 0) + 1
    rounds = len({a.round for a in history})
    order = ["correct", "flagged", "incorrect", "runtime_error", "timeout", "load_error", "compile_error"]
    names = sorted(counts, key=lambda k: (order.index(k) if k in order else len(order), k))
    detail = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in names)
    return f"{len(history)} attempt{'s' if len(history) != 1 else ''} over {rounds} round{'s' if rounds != 1 else ''} ({detail})"


def _reference_times(history: list[AttemptView]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    eager = compiled = floor = None
    for a in sorted(history, key=lambda a: a.attempt_id):
        r = a.result
        if r is None:
            continue
        eager = r.eager_time.median_ms if r.eager_time else eager
        compiled = r.compile_time.median_ms if r.compile_time else compiled
        floor = r.floor_ms if r.floor_ms is not None else floor
    return eager, compiled, floor


def _attempt_view(role: str, a: AttemptView, max_source_chars: int) -> dict[str, Any]:
    title = {"best": "Best so far", "failure": "Failed", "correct": "Also correct"}[role]
    if role == "failure" and failure_kind(a) == "flagged":
        title = "Flagged"
    focus = None
    r = a.result
    if r is not None and r.build is not None and not r.build.ok:
        focus = r.build.first_error_line
    limit = max_source_chars if role == "best" else max_source_chars // 2
    return {"title": f"{title}: {a.label} (round {a.round}, sample {a.sample})",
            "headline": headline(a), "evidence": evidence(a),
            "source": cap_source(a.source, limit, focus) if a.source else None}


def build_proposal_messages(task: TaskSpec, device: DeviceFacts, round: int, history: list[AttemptView],
                            analysis: Optional[str], floor_ms: Optional[float], max_attempts_shown: int = 4,
                            max_source_chars: int = MAX_SOURCE_CHARS,
                            numerics: Optional[Numerics] = None, max_analysis_chars: int = MAX_ANALYSIS_CHARS,
                            include_example: bool = True,
                            left_out: Optional[list[str]] = None,
                            backend: Optional[str] = None) -> tuple[str, list[dict[str, str]], str]:
    """(template name, messages, sha256) for one round of one task: ``propose_first`` when
    ``history`` is empty, else ``propose_refine``; ``numerics`` is the run's convention.
    ``max_source_chars`` 0 shows no sources, ``max_analysis_chars`` 0 no analysis; ``left_out``
    is said in the prompt (see ``fit_proposal_messages``); ``backend`` what the kernels are written in
    (``sandbox.backends``; None: the device's load_inline backend)."""
    ctx: dict[str, Any] = {"task": task, "device": device, "round": round, "floor_ms": floor_ms,
                           "backend": backend or device.device,
                           "numerics": numerics or Numerics(), "left_out": list(left_out or []),
                           "include_example": include_example}
    if not history:
        messages, sha = render(FIRST, **ctx)
        return FIRST, messages, sha
    chosen = choose_attempts(history, max_attempts_shown)
    eager, compiled, stored_floor = _reference_times(history)
    best = next((a for role, a in chosen if role == "best"), None)
    ctx.update(
        floor_ms=floor_ms if floor_ms is not None else stored_floor,
        eager_ms=eager, compile_ms=compiled,
        summary=_summary(history), total=len(history),
        shown=[_attempt_view(role, a, max_source_chars) for role, a in chosen],
        best=best.label if best else None,
        failures=any(role == "failure" for role, _ in chosen),
        analysis=(cap_text(analysis, max_analysis_chars) if analysis and analysis.strip() and max_analysis_chars > 0
                  else None),
    )
    messages, sha = render(REFINE, **ctx)
    return REFINE, messages, sha


# (attempts shown, source characters, analysis characters), fullest first; the task, the
# device, the reference timings, the summary of all attempts and the output contract stay.
REFINE_LADDER = [(4, MAX_SOURCE_CHARS, MAX_ANALYSIS_CHARS), (3, MAX_SOURCE_CHARS, MAX_ANALYSIS_CHARS),
                 (2, 4000, 3000), (1, 4000, 3000), (1, 2000, 1500), (1, 0, 1500), (1, 0, 0), (0, 0, 0)]


def _refine_left_out(history: list[AttemptView], analysis: Optional[str], shown: int, source_chars: int,
                     analysis_chars: int) -> list[str]:
    out: list[str] = []
    full = len(choose_attempts(history, REFINE_LADDER[0][0]))
    kept = len(choose_attempts(history, shown))
    if kept < full:
        out.append(f"{full - kept} of the {full} earlier attempts chosen to show" if kept else
                   "every earlier attempt (only the summary above is left)")
    if kept:
        if source_chars == 0:
            out.append("the earlier attempts' sources (their evidence is kept)")
        elif source_chars < MAX_SOURCE_CHARS:
            out.append(f"the earlier attempts' sources beyond {source_chars} characters each")
    if analysis and analysis.strip():
        if analysis_chars == 0:
            out.append("the analysis of the attempts so far")
        elif analysis_chars < MAX_ANALYSIS_CHARS and len(analysis.strip()) > analysis_chars:
            out.append(f"the analysis beyond its first {analysis_chars} characters")
    return out


def fit_proposal_messages(task: TaskSpec, device: DeviceFacts, round: int, history: list[AttemptView],
                          analysis: Optional[str], floor_ms: Optional[float], numerics: Optional[Numerics],
                          budget: Any, count: Any, backend: Optional[str] = None) -> tuple[str, list[dict[str, str]], str, list[str]]:
    """``build_proposal_messages`` fitted to the model's window (``agent.fitting``): fewer
    earlier attempts first, then shorter sources, a shorter analysis, no sources, no analysis
    (and for a first round, no worked example); never the task or the output contract. Returns
    (template, messages, sha256, what was left out); raises ``fitting.PromptTooLarge``."""
    from agent.fitting import Fitted, fit

    def variant(shown: int = 4, source_chars: int = MAX_SOURCE_CHARS, analysis_chars: int = MAX_ANALYSIS_CHARS,
                example: bool = True):
        def make() -> Fitted:
            left = (_refine_left_out(history, analysis, shown, source_chars, analysis_chars) if history
                    else ([] if example else ["the worked example"]))
            built = build_proposal_messages(task, device, round, history, analysis, floor_ms, shown, source_chars,
                                            numerics, analysis_chars, example, left, backend)
            return Fitted(value=built, messages=built[1], left_out=left)
        return make

    if history:
        variants = [variant(n, src, ana) for n, src, ana in REFINE_LADDER]
    else:
        variants = [variant(), variant(example=False)]
    got = fit(variants, budget, count, what=f"proposal prompt of {task.name}")
    template, messages, sha = got.value
    return template, messages, sha, got.left_out
