"""The formatters every figure in an analysis is written with (a unit, a fixed precision), so
``agent.critic.numbers`` can check what is written against what is stored."""
from __future__ import annotations

import math


def sig(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant figures, in positional notation (no exponent)."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    exponent = math.floor(math.log10(abs(value)))
    decimals = max(digits - 1 - exponent, 0)
    text = f"{value:.{decimals}f}"
    # rounding can carry into a new digit (9.996 -> 10.00): drop the extra decimal
    if decimals > 0 and len(text.replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{value:.{decimals - 1}f}"
    return text


def fmt_ms(value_ms: float) -> str:
    return f"{sig(value_ms, 3)} ms"


def fmt_us(value_us: float) -> str:
    return f"{sig(value_us, 3)} us"


def fmt_s(value_s: float) -> str:
    return f"{sig(value_s, 3)} s"


def fmt_x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def fmt_pct(fraction: float) -> str:
    """A stored fraction (0..1) written as a percentage."""
    return f"{sig(fraction * 100.0, 3)}%"


def fmt_num(value: float) -> str:
    """A unitless measured value (an error, a tolerance): three significant figures."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e4:
        return sig(value, 3)
    return f"{value:.2e}"
