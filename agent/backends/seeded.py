"""``--seed-with builtin``: a model starts where the built-in proposer ends.

``SeededBackend`` answers a run's first ``seed_rounds`` rounds with the seed backend (the
built-in fusion generator) and every later round with the model. The seed's candidates are
evaluated and profiled like any attempt, so the model's first round is a refine round: its
prompt (``propose_refine``) shows the seed's fastest correct candidate, its source, timings,
profile and roofline fraction, with that attempt as the parent of every sample, and asks for a
faster one. The model's tokens go to beating a compiler-grade kernel, not to rediscovering it.

Each model call is stored under the backend that answered it (``model_calls.model``:
``builtin`` for the seed's), the run under the model's name.
"""
from __future__ import annotations

from typing import Any

from agent.backends.base import BackendError, ModelBackend, get_backend
from agent.types import Completion, ProposalRequest

SEED_BACKENDS = ("builtin",)


class SeededBackend:
    def __init__(self, model: ModelBackend, seed: ModelBackend, seed_rounds: int = 1):
        self.model = model
        self.seed = seed
        self.seed_rounds = seed_rounds
        self.name = model.name
        self.default_critic = model.default_critic
        self.max_concurrency = model.max_concurrency

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        backend = self.seed if request.round < self.seed_rounds else self.model
        return backend.complete(request, sample)

    def __getattr__(self, item: str) -> Any:
        # the model's prompt budget, token counter and window (agent.fitting) are the prompt's
        return getattr(self.model, item)


def seeded_backend(model: ModelBackend, seed_with: str, model_spec: str, **options: Any) -> SeededBackend:
    """``model`` seeded by the backend ``seed_with`` names (one of ``SEED_BACKENDS``) for one round."""
    if seed_with not in SEED_BACKENDS:
        raise BackendError(f"--seed-with must be one of {', '.join(SEED_BACKENDS)}, not {seed_with!r}")
    if model_spec.partition(":")[0] == seed_with:
        raise BackendError(f"--seed-with {seed_with} seeds a model's run; --model is {model_spec} already")
    return SeededBackend(model, get_backend(seed_with), seed_rounds=1)
