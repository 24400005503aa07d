"""The executor interface: what the loop and ``replay`` ask of whatever evaluates candidates.

``sandbox.evaluate.Sandbox`` is the reference implementation (the ``local`` executor is a
Sandbox). An executor evaluates one candidate of one task and returns its ``EvalResult``; it
is thread-safe (the loop evaluates many candidates at once) and never writes the store: the
driver (the process running the loop) is the store's one writer.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from sandbox.admission import TaskTooLarge
from sandbox.result import EvalConfig, EvalResult
from sandbox.tasks import TaskSpec


class ExecutorError(Exception):
    """An executor cannot be opened or used; the message says why and what to do."""


@runtime_checkable
class Executor(Protocol):
    device: str
    device_name: str            # the evaluating device's name (part of the evaluation cache key)
    torch_version: str          # torch on the evaluating side (part of the cache key)
    config: EvalConfig
    slots: list[Any]            # one entry per evaluation slot (GPU, or the CPU)

    def evaluate(self, spec: TaskSpec, source: str) -> EvalResult:
        """The candidate's verdict; harness failures end as ``infra_error`` (never raised)."""

    def too_large(self, spec: TaskSpec) -> Optional[TaskTooLarge]:
        """Whether the task cannot fit even alone on one slot."""

    def release(self, spec: TaskSpec) -> None:
        """The task is done: its reference workers may stop."""

    def abort(self) -> None:
        """Stop everything in flight now (an interrupted run); results after this are not verdicts."""

    def close(self) -> None:
        """Stop every worker this executor started."""


def device_facts_of(executor: Any) -> Optional[dict[str, Any]]:
    """The evaluating device's facts (``agent.types.DeviceFacts`` fields) where the executor
    measured them on its own slots, else None (the caller measures on this host, as before)."""
    facts = getattr(executor, "device_facts", None)
    return facts() if callable(facts) else None
