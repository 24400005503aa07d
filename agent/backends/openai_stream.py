"""Reading one streamed chat completion under three time limits instead of one total timeout.

* ``first_token_s``: from sending the request to its first chunk. It covers the server's
  queue and the prompt's processing, so it is generous (600 s by default): requests beyond
  the server's slots wait at our side (``context.Limiter``) and do not count against it;
  what still waits at the server (other clients, servers that do not say how many slots
  they have) does. Past it the request is abandoned and retried: a server that sends
  nothing for that long is taken for dead.
* ``stall_s``: the longest silence between two chunks once the answer flows (120 s by
  default). Past it the answer received so far is kept, marked cut off (``ended_by="stall"``):
  a call that was receiving tokens is never retried from scratch for being slow.
* ``budget_s``: the whole call (1800 s by default, 0 for none). Past it the partial answer
  is kept, marked cut off (``ended_by="time_budget"``).

The stream is read by a thread of its own; this thread waits on its chunks with those
limits and, when it gives up, shuts the connection down so the server stops generating
(llama.cpp and vLLM cancel a request whose client went away). The in-flight slot is given
back only when the reading thread has finished, so slots count what the server runs.

A server that ignores ``stream`` (simple servers, some proxies) answers a streamed request with
a whole JSON completion and no events: that answer is read as the completion it is
(``StreamResult.whole``), not taken for an empty stream; the backend then stops streaming.

Reasoning: ``delta.reasoning_content`` (llama.cpp, SGLang, DeepSeek) or ``delta.reasoning``
(vLLM, OpenRouter) is collected apart from the answer; ``<think>...</think>`` inside the
content is split off afterwards (``split_think``).
"""
from __future__ import annotations

import json
import queue
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import openai


class FirstTokenTimeout(Exception):
    """Nothing arrived within ``first_token_s``."""


@dataclass
class Limits:
    first_token_s: float
    stall_s: float
    budget_s: float              # 0: none


@dataclass
class StreamResult:
    text: str = ""
    reasoning: str = ""
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    reasoning_tokens: Optional[int] = None
    ended_by: Optional[str] = None            # None | "stall" | "time_budget" | "broken"
    note: Optional[str] = None                # what ended it, in words
    first_chunk_s: Optional[float] = None
    chunks: int = 0
    model: Optional[str] = None
    extras: dict[str, Any] = field(default_factory=dict)
    whole: bool = False                       # a streamed request answered with a whole completion


def completion_result(response: Any) -> StreamResult:
    """A whole (not streamed) chat completion as a ``StreamResult`` of one chunk; ValueError
    when it has no choices."""
    choices = getattr(response, "choices", None)
    if not choices:
        raise ValueError(f"no choices in {str(response)[:200]!r}")
    choice = choices[0]
    message = getattr(choice, "message", None)
    got = StreamResult(chunks=1, finish_reason=getattr(choice, "finish_reason", None),
                       model=getattr(response, "model", None))
    got.text = (getattr(message, "content", None) if message is not None else None) or ""
    got.reasoning = reasoning_of(message) if message is not None else ""
    got.prompt_tokens, got.completion_tokens, got.reasoning_tokens = usage_figures(getattr(response, "usage", None))
    return got


def whole_answer(stream: Any) -> Optional[Any]:
    """The whole JSON completion a server sent instead of events to a streamed request, or None
    (events, or a body that is no completion: then the body, read and kept by httpx, is left to
    the event reader)."""
    response = getattr(stream, "response", None)
    headers = getattr(response, "headers", None)
    if response is None or headers is None or "event-stream" in headers.get("content-type", "").lower():
        return None
    body = response.read()
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return None
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_construct(**data)   # lenient, nested, as the client builds answers


def reasoning_of(delta: Any) -> str:
    """The reasoning text of a delta or message, under either name servers use."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(delta, name, None)
        if value is None and getattr(delta, "model_extra", None):
            value = delta.model_extra.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_think(text: str) -> tuple[str, str]:
    """(answer, reasoning) of a text that may carry ``<think>...</think>``; an unclosed
    ``<think>`` (an answer cut off while reasoning) is all reasoning."""
    if "<think>" not in text and "</think>" not in text:
        return text, ""
    parts = [m.group(1).strip() for m in _THINK.finditer(text)]
    answer = _THINK.sub("", text)
    if "</think>" in answer:                  # a template that opened <think> in the prompt
        head, answer = answer.rsplit("</think>", 1)
        parts.insert(0, head.replace("<think>", "").strip())
    elif "<think>" in answer:
        answer, tail = answer.split("<think>", 1)
        parts.append(tail.strip())
    return answer.strip("\n"), "\n\n".join(p for p in parts if p)


def usage_figures(usage: Any) -> tuple[Optional[int], Optional[int], Optional[int]]:
    if usage is None:
        return None, None, None
    details = getattr(usage, "completion_tokens_details", None)
    reasoning = getattr(details, "reasoning_tokens", None) if details is not None else None
    return getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None), reasoning


def _shutdown(stream: Any) -> None:
    """Close the stream's connection now, also when another thread is blocked reading it."""
    response = getattr(stream, "response", None)
    sock = None
    try:
        ns = response.extensions.get("network_stream") if response is not None else None
        sock = ns.get_extra_info("socket") if ns is not None else None
    except Exception:  # noqa: BLE001 - best effort
        sock = None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    try:
        if response is not None:
            response.close()
    except Exception:  # noqa: BLE001 - closing an already broken stream
        pass


def read_stream(open_stream: Callable[[], Any], limits: Limits, release: Callable[[], None]) -> StreamResult:
    """Open the stream (``open_stream()`` sends the request) and read it under ``limits``.
    ``release`` is called once the reading thread is done with the connection. Raises what
    opening raised (``openai.APIStatusError``...) and ``FirstTokenTimeout``."""
    events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
    holder: dict[str, Any] = {}
    abandoned = threading.Event()

    def reader() -> None:
        try:
            stream = open_stream()
            holder["stream"] = stream
            if abandoned.is_set():
                _shutdown(stream)
                return
            whole = whole_answer(stream)
            if whole is not None:
                events.put(("whole", whole))
                return
            for chunk in stream:
                events.put(("chunk", chunk))
                if abandoned.is_set():
                    break
            events.put(("end", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            events.put(("error", exc))
        finally:
            release()

    start = time.monotonic()
    thread = threading.Thread(target=reader, name="openai-stream", daemon=True)
    thread.start()
    result = StreamResult()
    last = start

    def give_up() -> None:
        abandoned.set()
        if "stream" in holder:
            _shutdown(holder["stream"])

    while True:
        now = time.monotonic()
        if result.chunks == 0:
            wait = start + limits.first_token_s - now
        else:
            wait = last + limits.stall_s - now
        if limits.budget_s:
            wait = min(wait, start + limits.budget_s - now)
        try:
            kind, item = events.get(timeout=max(0.0, wait))
        except queue.Empty:
            now = time.monotonic()
            give_up()
            if result.chunks == 0:
                spent = now - start
                raise FirstTokenTimeout(f"no answer within {spent:.3g} s (first_token_timeout_s "
                                        f"{limits.first_token_s:g}, call_budget_s {limits.budget_s:g})")
            if limits.budget_s and now - start >= limits.budget_s - 1e-3:
                result.ended_by = "time_budget"
                result.note = f"the call's budget of {limits.budget_s:g} s (call_budget_s) ran out"
            else:
                result.ended_by = "stall"
                result.note = (f"the stream fell silent for {limits.stall_s:g} s (stall_timeout_s) "
                               f"after {result.chunks} chunks")
            return result
        if kind == "end":
            return result
        if kind == "whole":
            whole = completion_result(item)
            whole.whole, whole.first_chunk_s = True, time.monotonic() - start
            return whole
        if kind == "error":
            if result.chunks and isinstance(item, (openai.APIError, ValueError)):
                result.ended_by = "broken"
                result.note = f"the stream broke after {result.chunks} chunks: {type(item).__name__}: {item}"
                return result
            raise item
        last = time.monotonic()
        if result.chunks == 0:
            result.first_chunk_s = last - start
        result.chunks += 1
        _take(result, item)


def _take(result: StreamResult, chunk: Any) -> None:
    result.model = getattr(chunk, "model", None) or result.model
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        result.prompt_tokens, result.completion_tokens, result.reasoning_tokens = usage_figures(usage)
    for choice in getattr(chunk, "choices", None) or []:
        if getattr(choice, "index", 0) != 0:
            continue
        delta = getattr(choice, "delta", None)
        if delta is not None:
            result.text += getattr(delta, "content", None) or ""
            result.reasoning += reasoning_of(delta)
        if getattr(choice, "finish_reason", None):
            result.finish_reason = choice.finish_reason
