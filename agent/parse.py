"""Turning a model's answer into one candidate module.

Policy (what ``parse_answer`` takes from an answer, in order):

1. Reasoning. Text up to the last ``</think>`` is the model's scratch work and is dropped;
   only the answer after it is read. An answer that opens ``<think>`` and never closes it
   was cut off while thinking: ``truncated`` when ``finish_reason == "length"``, else
   ``no_code``.
2. Fenced blocks. Blocks open with a line of three or more backticks (or tildes), up to
   three spaces indented, and close with a line of at least as many of the same character.
   Blocks tagged ``python``/``py``/``python3`` are preferred; bare (untagged) blocks are
   read only when there is no Python block; blocks in other languages (``cpp``, ``cuda``,
   ``bash``...) are never the candidate (the kernels belong inside the Python module).
3. Choice among several blocks: the *last* block that defines ``class ModelNew`` (models
   revise as they write, so the last complete version is the answer); when none defines
   it, the longest block, reported as ``no_model_new``.
4. Unterminated block. A block that opens and never closes, and would be the candidate,
   is ``truncated`` when ``finish_reason == "length"`` (the answer hit max_tokens); when
   the model simply stopped without a closing fence, its content is read as a block.
   ``finish_reason == "length"`` with no code at all is also ``truncated``.
5. No fences. An answer without any fence that is, as a whole, a Python module defining
   ``ModelNew`` (it compiles) is accepted; otherwise the answer is ``no_code``.
6. Checks on the chosen source: it must define ``class ModelNew`` (``no_model_new``) and
   compile as Python (``compile()``; ``syntax_error`` with the line number and the line).

The chosen source is returned with every status except ``no_code`` (and ``truncated``
with no block), so the critic can quote what went wrong.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Optional

STATUSES = ("ok", "no_code", "no_model_new", "truncated", "syntax_error")

PYTHON_TAGS = {"python", "py", "python3", "py3"}
# An opening fence; no backtick may follow a backtick fence (```x``` on one line is inline code).
_OPEN = re.compile(r"^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`\n]*$")
_MODEL_NEW = re.compile(r"^[ \t]*class[ \t]+ModelNew\b", re.MULTILINE)


@dataclass
class ParsedAnswer:
    status: str                    # one of STATUSES
    source: Optional[str] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Block:
    lang: str                      # "python", "bare" or the tag as written (lower case)
    body: str
    closed: bool


def _lang_of(tag: str) -> str:
    tag = tag.strip().lower().lstrip("{.").rstrip("}")
    if not tag:
        return "bare"
    return "python" if tag in PYTHON_TAGS else tag


def find_blocks(text: str) -> list[_Block]:
    """Every fenced block of ``text`` in order; the last may be unterminated."""
    lines = text.split("\n")
    blocks: list[_Block] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.group(1), m.group(2), m.group(3)
        closing = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j])
            j += 1
        closed = j < len(lines)
        content = "\n".join(body)
        if indent:
            content = textwrap.dedent(content)
        blocks.append(_Block(lang=_lang_of(tag), body=content.strip("\n") + "\n", closed=closed))
        i = j + 1
    return blocks


def defines_model_new(source: str) -> bool:
    return _MODEL_NEW.search(source) is not None


def syntax_error_of(source: str) -> Optional[str]:
    """``None`` when ``source`` compiles as Python, else the error with its line."""
    try:
        compile(source, "<candidate>", "exec")
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        text = (exc.text or "").rstrip("\n")
        if not text and exc.lineno:
            lines = source.splitlines()
            if 0 < exc.lineno <= len(lines):
                text = lines[exc.lineno - 1]
        detail = f": {text.strip()}" if text.strip() else ""
        return f"syntax error at {where}: {exc.msg}{detail}"
    except ValueError as exc:      # e.g. null bytes in the source
        return f"source cannot be compiled: {exc}"
    return None


def _check(source: str) -> ParsedAnswer:
    if not defines_model_new(source):
        return ParsedAnswer("no_model_new", source,
                            "the code block does not define class ModelNew(nn.Module)")
    err = syntax_error_of(source)
    if err:
        return ParsedAnswer("syntax_error", source, err)
    return ParsedAnswer("ok", source, None)


def parse_answer(text: Optional[str], finish_reason: Optional[str] = None) -> ParsedAnswer:
    """Apply the module's policy to one answer; see the module docstring."""
    cut_off = finish_reason == "length"
    text = (text or "").replace("\r\n", "\n").replace("\r", "\n")

    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif re.search(r"<think>", text):
        if cut_off:
            return ParsedAnswer("truncated", None,
                                "the answer was cut off at max_tokens while still reasoning (<think> never closed)")
        return ParsedAnswer("no_code", None, "the answer holds only reasoning (<think> never closed) and no code")

    blocks = find_blocks(text)
    python = [b for b in blocks if b.lang == "python"]
    candidates = python or [b for b in blocks if b.lang == "bare"]

    if not candidates:
        if cut_off:
            return ParsedAnswer("truncated", None,
                                "the answer was cut off at max_tokens before any code block was complete")
        if not blocks:
            stripped = text.strip()
            if stripped and defines_model_new(stripped) and syntax_error_of(stripped + "\n") is None:
                return ParsedAnswer("ok", stripped + "\n", None)
            return ParsedAnswer("no_code", None, "the answer holds no code block (expected one ```python block)")
        langs = ", ".join(sorted({b.lang for b in blocks}))
        return ParsedAnswer("no_code", None,
                            f"the answer holds no ```python block (only {langs} blocks); "
                            "kernels belong inside the Python module, passed to load_inline")

    last = candidates[-1]
    if not last.closed and cut_off:
        return ParsedAnswer("truncated", last.body,
                            f"the answer was cut off at max_tokens inside a code block "
                            f"({len(last.body.splitlines())} lines written)")

    with_model_new = [b for b in candidates if defines_model_new(b.body)]
    chosen = with_model_new[-1] if with_model_new else max(candidates, key=lambda b: len(b.body))
    return _check(chosen.body)
