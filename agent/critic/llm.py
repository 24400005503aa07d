"""The LLM critic: a language model's analysis, its numbers checked against the evidence.

The prompt (``prompts/critic_system.j2`` + ``prompts/critic_task.j2``) carries the task's
source, every attempt's code (capped) with its stored evidence, and the grounded critic's
findings. The prompt gives each attempt the same structured evidence the grounded critic reads: its error
patterns (``agent.critic.patterns``), its speed claims with their intervals
(``agent.critic.uncertainty``) and its profile. Every number with a unit in the answer
(runtimes, speedups, shares, bandwidths, FLOP or byte counts) is checked against the stored
figures, and every speed label against the interval it quotes. An answer with a number that
matches nothing, or a label its interval contradicts, is sent back once with the list of what
failed, and the model's second answer is kept; what is still wrong in it is listed in an appended
"Numbers not found in the evidence" section and as ``unverified_number`` /
``contradicted_speed`` findings (a ``regenerated`` finding records the first answer's problems).
The structured findings are the grounded critic's (a model's prose is not parsed into claims),
plus those.

When the backend fails (``Completion.error``, an exception, an empty answer) the analysis
is the grounded critic's, with a note saying so; the failed completion is still returned
so the call can be recorded.
"""
from __future__ import annotations

import dataclasses

import re
from typing import Any, Optional

import jinja2

from agent.critic.base import register
from agent.critic.grounded import (GroundedCritic, evidence_lines, reference_profile_lines, task_context)
from agent.critic.numbers import Quantity, check_text, evidence_figures, unverified_section
from agent.critic.patterns import classify
from agent.critic.uncertainty import contradictions, speed_claim
from agent.types import AnalysisOut, AttemptView, Completion, DeviceFacts, Finding
from sandbox.tasks import TaskSpec, with_device_sizes

SYSTEM_TEMPLATE = "critic_system.j2"
TASK_TEMPLATE = "critic_task.j2"
TEMPLATE = "critic_task"            # the name recorded with the model call

MAX_CODE_CHARS = 6000               # per attempt
MAX_TASK_CHARS = 8000


def environment() -> jinja2.Environment:
    from kernelloop.paths import prompts_dir

    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(prompts_dir())), undefined=jinja2.StrictUndefined,
                              autoescape=False, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def cap_code(source: str, limit: int) -> tuple[str, bool]:
    """``source`` cut to ``limit`` characters: its head and tail, the cut marked."""
    if len(source) <= limit:
        return source, False
    head = source[: int(limit * 0.7)]
    tail = source[-int(limit * 0.25):]
    head = head[: head.rfind("\n") + 1] or head
    tail = tail[tail.find("\n") + 1:] if "\n" in tail else tail
    cut = len(source) - len(head) - len(tail)
    return f"{head}# ... [{cut} characters cut] ...\n{tail}", True


def strip_reasoning(text: str) -> str:
    """Drop a reasoning preamble a model may emit before its answer (``<think>...</think>``)."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    return text.strip()


def attempt_patterns(a: AttemptView) -> list[str]:
    """``[kind] sentence`` of each error pattern of the attempt's first failed trial."""
    t = a.result.first_failed_trial() if a.result is not None else None
    return [f"[{p.kind}] output {o.index}: {p.sentence}" for o in (t.outputs if t else [])
            for p in classify(o.locations, o.numel)]


def attempt_speed(a: AttemptView) -> list[str]:
    """Its speed claims against eager and torch.compile, each with its interval and label."""
    r = a.result
    if r is None or not r.correct or r.candidate_time is None:
        return []
    return [f"[{c.label}] {c.sentence}" for c in (speed_claim(r, b) for b in ("eager", "compile")) if c is not None]


def problems(text: str, evidence) -> tuple[list[Quantity], list[str]]:
    """Numbers in ``text`` no stored figure explains, and speed sentences their interval contradicts."""
    return check_text(text, evidence), contradictions(text)


def retry_message(unverified: list[Quantity], contradicted: list[str]) -> str:
    lines = ["Some statements in your analysis do not match the evidence:"]
    lines += [f"- {q} (in: \u201c{q.context}\u201d) matches no stored figure" for q in unverified]
    lines += [f"- \u201c{c}\u201d: the speed label contradicts the interval it quotes" for c in contradicted]
    lines.append("Rewrite the whole analysis. Quote only figures that appear in the evidence, with its units, and "
                 "call an attempt faster or slower only when its interval excludes 1x (otherwise: inconclusive).")
    return "\n".join(lines)


@register("llm")
class LLMCritic:
    name = "llm"

    def __init__(self, backend: Any = None, max_code_chars: int = MAX_CODE_CHARS,
                 include_grounded: bool = True, **_options: Any):
        if backend is None or not hasattr(backend, "chat"):
            raise ValueError("the llm critic needs a model backend with a chat(messages) method "
                             "(e.g. agent.backends.base.get_backend('openai:<model>'))")
        self.backend = backend
        self.max_code_chars = max_code_chars
        self.include_grounded = include_grounded
        self.grounded = GroundedCritic()

    # ------------------------------------------------------------------ prompt
    def context(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts,
                grounded: Optional[AnalysisOut], max_code_chars: Optional[int] = None,
                include_grounded: Optional[bool] = None, left_out: Optional[list[str]] = None) -> dict[str, Any]:
        max_code_chars = self.max_code_chars if max_code_chars is None else max_code_chars
        include_grounded = self.include_grounded if include_grounded is None else include_grounded
        ctx = task_context(task, device)
        diags = {d.attempt.attempt_id: d for d in self.grounded.diagnose(task, attempts, device)}
        spec = with_device_sizes(task, device.device) if device else task
        rows = []
        for a in sorted(attempts, key=lambda x: (x.round, x.sample, x.attempt_id)):
            code, cut = cap_code(a.source or "", max_code_chars) if a.source and max_code_chars > 0 else ("", False)
            d = diags.get(a.attempt_id)
            rows.append({"id": a.attempt_id, "round": a.round, "sample": a.sample,
                         "verdict": d.verdict if d else (a.result.status.value if a.result else "no candidate"),
                         "evidence": evidence_lines(a), "code": code, "code_cut": cut,
                         "patterns": attempt_patterns(a), "speed": attempt_speed(a)})
        device_lines = []
        if device is not None:
            if device.bandwidth_gbps:
                device_lines.append(f"measured memory bandwidth: {device.bandwidth_gbps:.0f} GB/s")
            if device.tflops:
                device_lines.append("measured peak: " + ", ".join(
                    f"{k} {v:.3g} TFLOP/s" for k, v in sorted(device.tflops.items())))
            if device.sm_count:
                device_lines.append(f"SMs: {device.sm_count}")
        source, _ = cap_code(task.source, MAX_TASK_CHARS)
        grounded_lines = []
        if grounded is not None and include_grounded:
            grounded_lines = [f"attempt {f.attempt_id}: [{f.category}] {f.cause}" if f.attempt_id is not None
                              else f"[{f.category}] {f.cause}" for f in grounded.findings
                              if f.category not in ("best",)]
        sizes = ", ".join(f"{k}={v!r}" for k, v in sorted(spec.overrides.items())) if spec.overrides else ""
        return {"task": task, "task_source": source, "device": device, "device_lines": device_lines,
                "sizes": sizes, "attempts": rows, "reference_profile": reference_profile_lines(attempts),
                "grounded": grounded_lines, "constants": ctx.constants, "left_out": list(left_out or []),
                "code_left_out": max_code_chars <= 0,
                # what the kernels are written in: the attempts' (sandbox.backends), else the device's own
                "backend": next((a.result.config.backend for a in attempts if a.result is not None
                                 and a.result.config is not None and a.result.config.backend), None)
                or (device.device if device is not None else None)}

    def messages(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts,
                 grounded: Optional[AnalysisOut] = None, max_code_chars: Optional[int] = None,
                 include_grounded: Optional[bool] = None, left_out: Optional[list[str]] = None) -> list[dict[str, str]]:
        env = environment()
        ctx = self.context(task, attempts, device, grounded, max_code_chars, include_grounded, left_out)
        system = env.get_template(SYSTEM_TEMPLATE).render(**ctx).strip()
        user = env.get_template(TASK_TEMPLATE).render(**ctx).strip()
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def fitted_messages(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts,
                        grounded: Optional[AnalysisOut] = None) -> tuple[list[dict[str, str]], list[str]]:
        """``messages`` fitted to the model's window (``agent.fitting``): the attempts' code cut
        shorter, then left out, then the grounded findings; the evidence of every attempt stays.
        Returns (messages, what was left out); raises ``fitting.PromptTooLarge``."""
        from agent.fitting import Fitted, budget_of, fit

        full = self.max_code_chars

        def variant(code_chars: int, with_grounded: bool = True):
            def make() -> Fitted:
                left: list[str] = []
                if code_chars <= 0:
                    left.append("the attempts' code (their evidence is kept)")
                elif code_chars < full:
                    left.append(f"the attempts' code beyond {code_chars} characters each")
                if not with_grounded and self.include_grounded:
                    left.append("the deterministic check's findings")
                msgs = self.messages(task, attempts, device, grounded, code_chars, with_grounded and self.include_grounded,
                                     left)
                return Fitted(value=msgs, messages=msgs, left_out=left)
            return make

        steps = [c for c in (full, full // 2, full // 4, full // 10) if c > 0]
        variants = [variant(c) for c in steps] + [variant(0), variant(0, with_grounded=False)]
        budget, count = budget_of(self.backend)
        got = fit(variants, budget, count, what=f"critique prompt of {task.name}")
        return got.messages, got.left_out

    # ------------------------------------------------------------------ analysis
    def analyze(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> AnalysisOut:
        grounded = self.grounded.analyze(task, attempts, device)
        model_name = getattr(self.backend, "name", type(self.backend).__name__)
        left_out: list[str] = []
        try:
            messages, left_out = self.fitted_messages(task, attempts, device, grounded)
        except Exception as exc:  # noqa: BLE001 - PromptTooLarge (or the window could not be asked): no call
            messages = self.messages(task, attempts, device, grounded)
            completion = Completion(text="", model=model_name, error=f"{type(exc).__name__}: {exc}",
                                    finish_cause="error")
            return self._fallback(grounded, model_name, completion, messages, left_out)
        try:
            completion = self.backend.chat(messages)
        except Exception as exc:  # noqa: BLE001 - any backend failure falls back to the grounded analysis
            completion = Completion(text="", model=model_name, error=f"{type(exc).__name__}: {exc}")
        text = strip_reasoning(completion.text or "") if completion.error is None else ""
        if completion.error is not None or not text:
            return self._fallback(grounded, model_name, completion, messages, left_out)
        evidence = evidence_figures(attempts, device)
        unverified, contradicted = problems(text, evidence)
        first_problems: Optional[tuple[list[Quantity], list[str]]] = None
        if unverified or contradicted:
            retry = messages + [{"role": "assistant", "content": text},
                                {"role": "user", "content": retry_message(unverified, contradicted)}]
            try:
                second = self.backend.chat(retry)
            except Exception as exc:  # noqa: BLE001 - keep the first answer, flagged
                second = Completion(text="", model=model_name, error=f"{type(exc).__name__}: {exc}")
            second_text = strip_reasoning(second.text or "") if second.error is None else ""
            if second_text:
                first_problems = (unverified, contradicted)
                completion = _combined(completion, second)
                messages, text = retry, second_text
                unverified, contradicted = problems(text, evidence)
        markdown = text.rstrip() + "\n"
        if completion.finish_reason == "length":
            markdown += "\n> The model's answer was cut off (finish_reason=length).\n"
        findings = list(grounded.findings)
        if first_problems is not None:
            n_bad = len(first_problems[0]) + len(first_problems[1])
            findings.append(Finding(attempt_id=None, category="regenerated",
                                    cause=f"the first answer had {n_bad} statement(s) the evidence does not support; "
                                          f"the analysis was regenerated once",
                                    evidence=[q.context for q in first_problems[0]] + first_problems[1]))
        if unverified:
            markdown += unverified_section(unverified)
            seen = set()
            for q in unverified:
                key = (q.text, q.unit)
                if key in seen:
                    continue
                seen.add(key)
                findings.append(Finding(attempt_id=None, category="unverified_number",
                                        cause=f"the analysis quotes {q} which matches no stored figure",
                                        evidence=[q.context], numbers={"quoted": q.value, "unit": q.unit}))
        if contradicted:
            markdown += ("\n## Speed labels contradicted by their intervals\n\n"
                         + "".join(f"- \u201c{c}\u201d\n" for c in contradicted))
            for c in contradicted:
                findings.append(Finding(attempt_id=None, category="contradicted_speed",
                                        cause="the analysis labels a speed that its own interval contradicts",
                                        evidence=[c]))
        return AnalysisOut(critic=self.name, markdown=markdown, findings=findings, completion=completion,
                           template=TEMPLATE, messages=messages, left_out=left_out)

    @staticmethod
    def _fallback(grounded: AnalysisOut, model_name: str, completion: Completion, messages: list[dict[str, str]],
                  left_out: list[str]) -> AnalysisOut:
        why = completion.error or "the model returned an empty answer"
        note = (f"> The language-model critic ({model_name}) failed: {why}. "
                f"This is the grounded analysis of the stored evidence instead.\n\n")
        findings = list(grounded.findings) + [
            Finding(attempt_id=None, category="llm_failed", cause=f"the llm critic failed ({why}); "
                                                                  f"grounded analysis used")]
        return AnalysisOut(critic="grounded", markdown=note + grounded.markdown, findings=findings,
                           completion=completion, template=TEMPLATE, messages=messages, left_out=left_out)


def _combined(first: Completion, second: Completion) -> Completion:
    """The second answer (its reasoning, finish cause and window included), with the tokens and
    cost of both calls."""
    def add(a, b):
        return None if a is None and b is None else (a or 0) + (b or 0)
    return dataclasses.replace(
        second, prompt_tokens=add(first.prompt_tokens, second.prompt_tokens),
        completion_tokens=add(first.completion_tokens, second.completion_tokens),
        reasoning_tokens=add(first.reasoning_tokens, second.reasoning_tokens),
        latency_s=first.latency_s + second.latency_s, cost_usd=add(first.cost_usd, second.cost_usd))
