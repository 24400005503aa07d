"""The model-backend interface and its registry.

``--model`` names a backend: ``openai:<model>`` (any OpenAI-compatible endpoint),
``builtin`` (the offline fusion proposer), ``replay:<run>`` (completions stored by an
earlier run). Backends are found through ``BACKENDS``; each is a small class with one
method, ``complete``.
"""
from __future__ import annotations

from typing import Callable, Protocol

from agent.types import Completion, ProposalRequest


class BackendError(Exception):
    """A backend that cannot be used as configured (missing key, unknown model, bad spec)."""


class ModelBackend(Protocol):
    name: str                      # as stored in runs.model, e.g. "openai:gpt-4o", "builtin"
    default_critic: str            # "llm" or "grounded"
    max_concurrency: int

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        """One completion for one sample of one round. Failures after retries set ``Completion.error``."""
        ...


BACKENDS: dict[str, Callable[..., ModelBackend]] = {}


def register(prefix: str) -> Callable:
    def deco(factory: Callable[..., ModelBackend]) -> Callable[..., ModelBackend]:
        BACKENDS[prefix] = factory
        return factory
    return deco


def get_backend(spec: str, **options) -> ModelBackend:
    """Make the backend ``spec`` names (``prefix`` or ``prefix:argument``)."""
    import agent.backends  # noqa: F401  (imports register the built-in backends)

    prefix, _, arg = spec.partition(":")
    factory = BACKENDS.get(prefix)
    if factory is None:
        raise BackendError(f"unknown model backend {spec!r}; known: "
                           + ", ".join(f"{p}:<arg>" if p != "builtin" else p for p in sorted(BACKENDS)))
    return factory(arg, **options)
