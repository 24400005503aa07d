"""The loop's data model: what backends and critics receive and return.

One shape flows through every stage: a stored attempt becomes an ``AttemptView`` (its
source and the sandbox's ``EvalResult``); backends answer with ``Completion``s; critics
answer with an ``AnalysisOut`` of markdown plus structured ``Finding``s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sandbox.numerics import Numerics
from sandbox.result import EvalResult
from sandbox.tasks import TaskSpec


@dataclass
class AttemptView:
    attempt_id: int
    round: int
    sample: int
    parse_status: str                    # ok | no_code | no_model_new | truncated | syntax_error | error
    source: Optional[str]
    result: Optional[EvalResult] = None  # None when the answer held no candidate
    parse_error: Optional[str] = None
    parent_ids: list[int] = field(default_factory=list)
    evaluation_id: Optional[int] = None

    @property
    def correct(self) -> bool:
        return self.result is not None and self.result.correct

    @property
    def label(self) -> str:
        return f"attempt {self.attempt_id}"


@dataclass
class DeviceFacts:
    device: str                          # cuda | cpu
    name: str
    torch_version: str
    compute_capability: Optional[str] = None
    sm_count: Optional[int] = None
    bandwidth_gbps: Optional[float] = None
    tflops: dict[str, float] = field(default_factory=dict)


@dataclass
class ProposalRequest:
    """One round of one task, as a backend sees it."""

    task: TaskSpec
    device: DeviceFacts
    round: int
    samples: int
    messages: list[dict[str, str]]       # rendered prompt for language-model backends
    template: str                        # prompt template name
    prompt_sha256: str
    history: list[AttemptView] = field(default_factory=list)   # every earlier attempt of this task
    analysis: Optional[str] = None       # the critic's latest analysis (markdown)
    run_id: Optional[int] = None
    numerics: Numerics = field(default_factory=Numerics)   # the run's precision and math mode
    left_out: list[str] = field(default_factory=list)      # what the prompt left out to fit the model's window
    kernel_backend: Optional[str] = None   # what kernels are written in (sandbox.backends); None: the device's load_inline


@dataclass
class Completion:
    text: str
    model: str
    finish_reason: Optional[str] = None  # stop | length | ...
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    latency_s: float = 0.0
    cost_usd: Optional[float] = None
    error: Optional[str] = None          # set when the call failed (the text is then empty)
    reasoning: Optional[str] = None      # reasoning the server returned apart from the answer (never fed back)
    reasoning_tokens: Optional[int] = None
    finish_cause: Optional[str] = None   # stop | max_tokens | window | time_budget | stall | broken | error
    prompt_truncated: bool = False       # the server counted far fewer prompt tokens than were sent
    context: dict[str, Any] = field(default_factory=dict)   # window, its source, counted prompt, max_tokens sent
    overflow: bool = False               # the server refused the request as larger than the window


@dataclass
class Finding:
    attempt_id: Optional[int]
    category: str                        # e.g. compile_error, nan_inf, wrong_shape, mismatch, faster, slower
    cause: str                           # one sentence
    evidence: list[str] = field(default_factory=list)   # references: "evaluation 12: max_abs_err=3.1e-2"
    numbers: dict[str, Any] = field(default_factory=dict)  # the stored figures the cause quotes

    def to_dict(self) -> dict[str, Any]:
        return {"attempt_id": self.attempt_id, "category": self.category, "cause": self.cause,
                "evidence": list(self.evidence), "numbers": dict(self.numbers)}


@dataclass
class AnalysisOut:
    critic: str
    markdown: str
    findings: list[Finding]
    completion: Optional[Completion] = None   # the model call behind an llm analysis
    template: Optional[str] = None
    messages: Optional[list[dict[str, str]]] = None
    left_out: list[str] = field(default_factory=list)        # what the prompt left out to fit the window
