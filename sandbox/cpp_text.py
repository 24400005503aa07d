"""Scanning C++/CUDA text with its string and character literals and its comments skipped, so the
brackets inside them do not count (``sandbox.cuda_split``; the critic's ``agent.critic.source``)."""
from __future__ import annotations

from typing import Optional


def skip_literal(text: str, i: int) -> int:
    """The index after the string or character literal that starts at ``text[i]``."""
    quote, i = text[i], i + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def skip_comment(text: str, i: int) -> Optional[int]:
    """Where the comment that starts at ``text[i]`` ends (a line comment: at its newline, kept; a block
    comment: after its ``*/``, or -1 where it is never closed); None where no comment starts there."""
    if text.startswith("//", i):
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        return -1 if j < 0 else j + 2
    return None


def matching(text: str, i: int, open_: str = "{", close: str = "}") -> int:
    """The index after the ``close`` that matches the ``open_`` at ``text[i]``, literals and comments
    skipped; -1 where there is none."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = skip_literal(text, i)
            continue
        if c == "/":
            j = skip_comment(text, i)
            if j is not None:
                if j < 0:
                    return -1
                i = j
                continue
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
            continue
        if text.startswith(close, i):
            depth -= 1
            i += len(close)
            if depth == 0:
                return i
            continue
        i += 1
    return -1
