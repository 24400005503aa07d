"""Numbers in an analysis, checked against the evidence they claim to quote.

An analysis may only quote figures that are stored (an ``EvalResult`` field, a kernel's
share in a profile, a device ceiling) or follow from stored figures by one documented
step (a fraction written as a percentage, the sum of a group of kernels' shares, the ratio
of two stored runtimes). ``evidence_figures`` lists them, each with its dimension;
``extract_quantities`` finds the numbers a markdown text quotes, with their units;
``check_text`` returns the quoted numbers that no figure explains.

A quoted number matches a figure of the same dimension when the figure, written in the
quoted unit and rounded to the quoted precision, gives the quoted digits (half a unit of
the last quoted digit either way). So "0.312 ms" matches a stored 0.31234 ms, but
"30.8 seconds" does not match a stored 30.8 ms, and "1.5x" does not match 1.23.

The formatting functions (``fmt_ms``, ``fmt_x``, ``fmt_pct``, ``fmt_num``) are the ones the
grounded critic writes with, so its own text always checks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Iterable, Optional

from agent.critic.figures import (  # noqa: F401
    Evidence,
    Figure,
    device_evidence,
    evidence_figures,
    is_annotation,
    kernel_groups,
    result_evidence,
)
from agent.critic.fmt import fmt_ms, fmt_num, fmt_pct, fmt_s, fmt_us, fmt_x, sig  # noqa: F401,E402  (re-exported)

# --------------------------------------------------------------------------------------
# units
# --------------------------------------------------------------------------------------

# dimension -> {unit spelling (lower-case unless noted): factor to the dimension's base unit}
# base units: time -> ms, ratio -> x, percent -> %, bandwidth -> GB/s, rate -> FLOP/s,
# flops -> FLOP, bytes -> B
_TIME = {"ns": 1e-6, "nanosecond": 1e-6, "nanoseconds": 1e-6,
         "us": 1e-3, "µs": 1e-3, "μs": 1e-3, "usec": 1e-3, "microsecond": 1e-3, "microseconds": 1e-3,
         "ms": 1.0, "msec": 1.0, "millisecond": 1.0, "milliseconds": 1.0,
         "s": 1e3, "sec": 1e3, "secs": 1e3, "second": 1e3, "seconds": 1e3}
_RATIO = {"x": 1.0, "×": 1.0, "times": 1.0}
_PERCENT = {"%": 1.0, "percent": 1.0}
_BANDWIDTH = {"tb/s": 1e3, "gb/s": 1.0, "gib/s": 1.073741824, "mb/s": 1e-3, "tbps": 1e3, "gbps": 1.0}
_BYTES = {"b": 1.0, "bytes": 1.0, "byte": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024.0, "mib": 1024.0 ** 2, "gib": 1024.0 ** 3}
_SCALE_WORDS = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}

DIMENSIONS = ("time", "ratio", "percent", "bandwidth", "rate", "flops", "bytes", "plain")


def _unit_table() -> list[tuple[str, str, float]]:
    rows = []
    for dim, table in (("time", _TIME), ("ratio", _RATIO), ("percent", _PERCENT),
                       ("bandwidth", _BANDWIDTH), ("bytes", _BYTES)):
        for spelling, factor in table.items():
            rows.append((spelling, dim, factor))
    rows.sort(key=lambda r: -len(r[0]))   # longest spelling first
    return rows


_UNITS = _unit_table()


def _classify_unit(unit: str) -> Optional[tuple[str, float]]:
    """(dimension, factor to its base unit) of a unit as written, or None."""
    u = unit.lower()
    m = re.fullmatch(r"([kmgtp]?)flop(s?)(/s)?", u)
    if m:
        prefix = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[m.group(1)]
        # "TFLOP/s" and "TFLOPS" (capital S, with a prefix) are rates; "FLOP", "FLOPs", "GFLOPs" counts
        if m.group(3) or (m.group(2) and unit.endswith("S") and m.group(1)):
            return "rate", prefix
        return "flops", prefix
    if u == "b" and unit != "B":
        return None
    for spelling, dim, factor in _UNITS:
        if u == spelling:
            return dim, factor
    return None


# --------------------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------------------

@dataclass
class Quantity:
    text: str               # the number as written ("0.312", "3.05e-01")
    value: float            # in the quoted unit
    unit: str               # as written ("ms", "x", "%", "" for none)
    dimension: str          # one of DIMENSIONS
    factor: float           # quoted unit -> the dimension's base unit
    quantum: float          # half-width of the interval the quoted digits stand for (quoted unit)
    start: int = 0
    context: str = ""

    @property
    def base_value(self) -> float:
        return self.value * self.factor

    def __str__(self) -> str:
        return f"{self.text}{'' if self.unit in ('%', 'x', '×') else ' '}{self.unit}".strip()


_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
_UNIT_ALT = "|".join(re.escape(s) for s, _, _ in _UNITS)
_UNIT_RE = (r"(?:(?:thousand|million|billion|trillion)\s+)?"
            r"(?:[KMGTP]?FLOP[sS]?(?:/s)?|[kKMGTP]i?B/s|[kKMGTP]i?B\b|bytes?\b|"
            + _UNIT_ALT + r")")
# number, optional range partner, optional unit; the number must not be glued to a word
_QTY = re.compile(
    r"(?<![\w.\-/])(?P<sign>[-+−])?(?P<num>" + _NUM + r")"
    r"(?:\s*(?:-|–|—|to)\s*(?P<num2>" + _NUM + r"))?"
    r"(?P<sep>[ \t\u00a0-]?)(?P<unit>" + _UNIT_RE + r")?"
    r"(?![\w])", re.IGNORECASE)

_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _strip_code(markdown: str) -> str:
    """Blank out code blocks and inline code (verbatim quotes of source, logs and names)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    text = _FENCE.sub(blank, markdown)
    return _CODE_SPAN.sub(blank, text)


def _quantum(num: str) -> float:
    """Half a unit of the last significant written digit of ``num``.

    An integer's trailing zeros may or may not be significant ("180 us" for 181.2 us), so
    they are read as not significant: "180" stands for 175 to 185."""
    s = num.replace(",", "")
    mantissa, _, exp = s.lower().partition("e")
    if "." in mantissa:
        decimals = len(mantissa.split(".")[1])
    else:
        stripped = mantissa.rstrip("0")
        decimals = -(len(mantissa) - len(stripped)) if stripped else 0
    q = 0.5 * 10.0 ** (-decimals)
    if exp:
        q *= 10.0 ** int(exp)
    return q


def _to_float(num: str) -> Optional[float]:
    try:
        return float(Decimal(num.replace(",", "")))
    except (InvalidOperation, ValueError):
        return None


def extract_quantities(markdown: str) -> list[Quantity]:
    """Every number in ``markdown`` outside code, with its unit (``plain`` when it has none)."""
    text = _strip_code(markdown)
    out: list[Quantity] = []
    for m in _QTY.finditer(text):
        unit_raw = (m.group("unit") or "")
        scale = 1.0
        unit = unit_raw
        sw = re.match(r"(thousand|million|billion|trillion)\s+", unit_raw, re.IGNORECASE)
        if sw:
            scale = _SCALE_WORDS[sw.group(1).lower()]
            unit = unit_raw[sw.end():]
        cls = _classify_unit(unit) if unit else None
        if unit and cls is None:
            cls = None
            unit = ""
        # "x"/"×" only as a suffix glued to the number ("1.23x"), never "3 x 3"
        if cls and cls[0] == "ratio" and unit.lower() in ("x", "×"):
            after = text[m.end():m.end() + 2]
            if m.group("sep") or re.match(r"\s*\d", after):
                cls, unit = None, ""
        # a bare "s" or "b" needs a space before it and must not start a word ("3 s", not "3s")
        if cls and unit.lower() in ("s", "b") and not m.group("sep"):
            cls, unit = None, ""
        dim, factor = cls if cls else ("plain", 1.0)
        sign = -1.0 if m.group("sign") in ("-", "−") else 1.0
        ctx_start = max(0, m.start() - 40)
        context = markdown[ctx_start:m.end() + 20].replace("\n", " ")
        for key in ("num", "num2"):
            num = m.group(key)
            if not num:
                continue
            value = _to_float(num)
            if value is None:
                continue
            value *= sign if key == "num" else 1.0
            out.append(Quantity(text=(("-" if sign < 0 and key == "num" else "") + num), value=value * scale,
                                unit=unit, dimension=dim, factor=factor, quantum=_quantum(num) * scale,
                                start=m.start(key), context=context.strip()))
    return out



# --------------------------------------------------------------------------------------
# checking
# --------------------------------------------------------------------------------------

def matches(q: Quantity, fig: Figure) -> bool:
    if q.dimension != fig.dimension:
        return False
    quoted = q.base_value
    tol = q.quantum * q.factor * 1.0001 + 1e-12 * max(abs(quoted), 1.0)
    if abs(fig.value - quoted) <= tol:
        return True
    return False


def find_match(q: Quantity, evidence: Evidence) -> Optional[Figure]:
    for fig in evidence.figures:
        if matches(q, fig):
            return fig
    return None


def check_text(markdown: str, evidence: Evidence, strict: bool = False,
               allowed_plain: Iterable[float] = ()) -> list[Quantity]:
    """Quoted numbers that no figure of the evidence explains.

    By default only numbers with a unit are checked (a runtime, a speedup, a share, a
    bandwidth, a FLOP or byte count): those are the claims about measurements. ``strict``
    also checks unitless non-integers (errors, tolerances, fractions); unitless integers
    (attempt ids, line numbers, element counts, sizes from the task's source) never are.
    """
    allowed = [float(v) for v in allowed_plain]
    bad: list[Quantity] = []
    for q in extract_quantities(markdown):
        if q.dimension == "plain":
            if not strict:
                continue
            is_integer = re.fullmatch(r"[-]?[\d,]+", q.text) is not None
            if is_integer:
                continue
            if any(abs(v - q.value) <= q.quantum * 1.0001 for v in allowed):
                continue
        if find_match(q, evidence) is None:
            bad.append(q)
    return bad


def check_every_number(markdown: str, evidence: Evidence, allowed: Iterable[float] = ()) -> list[Quantity]:
    """Every number outside code that no figure of the evidence explains: integers, unitless
    figures and figures with units alike (``allowed``: conventions such as the seeds' -1.0)."""
    allowed = [float(v) for v in allowed]
    bad = []
    for q in extract_quantities(markdown):
        if any(abs(v - q.value) <= q.quantum * 1.0001 for v in allowed):
            continue
        if find_match(q, evidence) is None:
            bad.append(q)
    return bad


def unverified_section(unverified: list[Quantity]) -> str:
    """The section appended to a language-model analysis whose numbers are not all stored."""
    lines = ["", "## Numbers not found in the evidence", "",
             "These figures in the analysis above match no stored measurement (with its unit) "
             "of this task's attempts; treat the statements that use them as unverified:", ""]
    seen = set()
    for q in unverified:
        key = (q.text, q.unit)
        if key in seen:
            continue
        seen.add(key)
        ctx = q.context.replace("|", "\\|")
        lines.append(f"- {q} (in: \u201c{ctx}\u201d)")
    return "\n".join(lines) + "\n"
