"""Fitting a prompt to the model's window: the fullest variant that fits, else the barest.

Callers (the proposal prompt in ``agent.prompts``, the critic's in ``agent.critic.llm``) give
their variants from fullest to barest, each with the list of what it leaves out (said in the
prompt itself and recorded with the call). The budget comes from the backend
(``prompt_budget()``: ``preferred`` leaves the answer its share of the window, ``hard`` only
the minimum); tokens are counted as the backend counts them (``count_prompt``). A prompt
whose barest variant exceeds ``hard`` cannot be asked: ``PromptTooLarge`` names the sizes.
Backends without a window (builtin, replay, a server that does not say) are not fitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol


class PromptTooLarge(Exception):
    """Even the barest prompt leaves the answer too little of the model's window."""


class Budget(Protocol):
    window: int
    window_source: str
    preferred: int
    hard: int
    min_answer_tokens: int


@dataclass
class Fitted:
    value: Any                          # whatever the variant built (messages, or a tuple holding them)
    messages: list[dict[str, str]]
    left_out: list[str]
    tokens: Optional[int] = None
    counted_by: Optional[str] = None


def budget_of(backend: Any) -> tuple[Optional[Budget], Optional[Callable]]:
    """The backend's prompt budget and token counter, or (None, None) where it has none."""
    get = getattr(backend, "prompt_budget", None)
    count = getattr(backend, "count_prompt", None)
    if get is None or count is None:
        return None, None
    budget = get()
    return (budget, count) if budget is not None else (None, None)


def fit(variants: Iterable[Callable[[], Fitted]], budget: Optional[Budget],
        count: Optional[Callable[[list[dict[str, str]]], tuple[int, str]]], what: str = "prompt") -> Fitted:
    """The first variant within ``budget.preferred``; else the barest, if within ``budget.hard``."""
    last: Optional[Fitted] = None
    for make in variants:
        last = make()
        if budget is None or count is None:
            return last
        last.tokens, last.counted_by = count(last.messages)
        if last.tokens <= budget.preferred:
            return last
    assert last is not None, "no variants"
    if last.tokens is not None and last.tokens <= budget.hard:
        return last
    raise PromptTooLarge(
        f"the {what} does not fit the model's window even with everything optional left out: "
        f"{last.tokens} tokens ({last.counted_by}) of a {budget.window}-token window ({budget.window_source}), "
        f"which must also leave at least {budget.min_answer_tokens} for the answer (min_answer_tokens); "
        f"left out: {'; '.join(last.left_out) or 'nothing'}. Serve the model with a larger window "
        f"(llama.cpp -c, vLLM --max-model-len, Ollama num_ctx) or set context_tokens if it has one")
