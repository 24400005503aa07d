"""The critic interface: ``grounded`` (deterministic, from stored evidence) and ``llm``."""
from __future__ import annotations

from typing import Callable, Protocol

from agent.types import AnalysisOut, AttemptView, DeviceFacts
from sandbox.tasks import TaskSpec


class Critic(Protocol):
    name: str

    def analyze(self, task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> AnalysisOut:
        ...


CRITICS: dict[str, Callable[..., Critic]] = {}


def register(name: str) -> Callable:
    def deco(factory):
        CRITICS[name] = factory
        return factory
    return deco


def get_critic(name: str, **options) -> Critic:
    import agent.critic  # noqa: F401  (imports register the critics)

    if name not in CRITICS:
        raise ValueError(f"unknown critic {name!r}; known: {', '.join(sorted(CRITICS))}")
    return CRITICS[name](**options)
