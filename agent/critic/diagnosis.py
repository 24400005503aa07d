"""One attempt's diagnosis: the verdict, findings, bullets and next steps, and the small
text helpers every part of the grounded critic writes with."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.critic.numbers import fmt_num, sig
from agent.types import AttemptView, DeviceFacts, Finding
from sandbox.result import Status
from sandbox.tasks import TaskSpec

VERDICTS = {
    Status.correct: "correct",
    Status.incorrect: "incorrect",
    Status.compile_error: "compile error",
    Status.load_error: "load error",
    Status.runtime_error: "runtime error",
    Status.timeout: "timeout",
    Status.infra_error: "harness failure (no verdict)",
}


@dataclass
class TaskContext:
    task: TaskSpec
    device: DeviceFacts
    constants: dict[str, int]
    group_norm: bool


@dataclass
class Diagnosis:
    attempt: AttemptView
    verdict: str
    short: str                                   # the comparison table's cause cell
    findings: list[Finding] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)
    next_steps: list[tuple[int, str, str]] = field(default_factory=list)   # (priority, key, markdown)

    def step(self, priority: int, key: str, text: str) -> None:
        """Something the next attempt should change; ``key`` merges the same advice across attempts."""
        self.next_steps.append((priority, key, text))

    def add(self, category: str, cause: str, evidence: Optional[list[str]] = None,
            numbers: Optional[dict[str, Any]] = None, bullet: Optional[str] = None) -> Finding:
        nums = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in (numbers or {}).items()}
        f = Finding(attempt_id=self.attempt.attempt_id, category=category, cause=cause,
                    evidence=list(evidence or []), numbers=nums)
        self.findings.append(f)
        self.bullets.append(bullet if bullet is not None else cause)
        return f


def evidence_ref(a: AttemptView, fieldname: str, value: Any) -> str:
    where = f"evaluation {a.evaluation_id}" if a.evaluation_id is not None else f"attempt {a.attempt_id}"
    return f"{where}: {fieldname}={value!r}"


def code_span(text: Optional[str], limit: int = 200) -> str:
    """Inline code span for verbatim text (compiler messages, names, source lines)."""
    t = " ".join((text or "").split())
    if len(t) > limit:
        t = t[:limit - 3] + "..."
    t = t.replace("`", "'")
    return f"`{t}`" if t else "``"


def first_line(text: Optional[str]) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def fmt_err(v: Optional[float]) -> str:
    """An error figure; the comparison stores an infinite difference as the largest float."""
    if v is None:
        return "n/a"
    if not math.isfinite(v) or abs(v) >= 1e300:
        return "inf"
    return fmt_num(v)


def int_or_sig(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else sig(v, 3)
