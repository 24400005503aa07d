"""What a model call cost, from a small table of per-million-token list prices.

Prices are US dollars per 1M tokens (input, output), as the providers listed them in
2025; they change, so a model may be priced (or re-priced) in the ``[pricing]`` section
of ``~/.config/kernelloop/config.toml``::

    [pricing]
    "my-local-model" = { input = 0.0, output = 0.0 }
    "gpt-4o" = { input = 2.5, output = 10.0 }

A model that is in neither gives ``None`` (unknown), never a guess.
"""
from __future__ import annotations

from typing import Mapping, Optional

# model -> (input, output) USD per 1M tokens
PRICES: dict[str, tuple[float, float]] = {
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-5-nano": (0.05, 0.40),
    "o1": (15.00, 60.00),
    "o3": (2.00, 8.00),
    "o3-mini": (1.10, 4.40),
    "o4-mini": (1.10, 4.40),
    "deepseek-chat": (0.27, 1.10),
    "deepseek-reasoner": (0.55, 2.19),
}


def price_of(model: str, extra: Optional[Mapping[str, tuple[float, float]]] = None) -> Optional[tuple[float, float]]:
    """(input, output) per 1M tokens for ``model``, or None when unknown.

    Looks for the exact name, then the name without a provider prefix (``openai/gpt-4o``),
    then the longest known name the model extends with ``-suffix`` (``gpt-4o-2024-08-06``
    is priced as ``gpt-4o``; ``gpt-4o-mini-2024-07-18`` as ``gpt-4o-mini``). ``extra``
    (prices from the config file) is consulted before the built-in table.
    """
    table: dict[str, tuple[float, float]] = dict(PRICES)
    if extra:
        table.update(extra)
    names = [model]
    if "/" in model:
        names.append(model.rsplit("/", 1)[1])
    for name in names:
        if name in table:
            return table[name]
    for name in names:
        prefixes = [k for k in table if name.startswith(k + "-")]
        if prefixes:
            return table[max(prefixes, key=len)]
    return None


def cost_usd(model: str, prompt_tokens: Optional[int], completion_tokens: Optional[int],
             extra: Optional[Mapping[str, tuple[float, float]]] = None) -> Optional[float]:
    """The call's cost in USD, or None when the model's price or the token counts are unknown."""
    price = price_of(model, extra)
    if price is None or prompt_tokens is None or completion_tokens is None:
        return None
    return (prompt_tokens * price[0] + completion_tokens * price[1]) / 1e6


def prices_from_config(section: Mapping[str, object]) -> dict[str, tuple[float, float]]:
    """Read a ``[pricing]`` table: ``model = { input = x, output = y }`` (USD per 1M tokens)."""
    out: dict[str, tuple[float, float]] = {}
    for model, entry in section.items():
        if not isinstance(entry, Mapping) or "input" not in entry or "output" not in entry:
            raise ValueError(f"[pricing] {model!r}: expected {{ input = <usd per 1M>, output = <usd per 1M> }}")
        out[str(model)] = (float(entry["input"]), float(entry["output"]))
    return out
