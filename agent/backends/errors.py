"""What a failed model call means, decided in one place (``classify``).

Three outcomes, each an exception type the retry layer acts on:

* ``Transient``: worth another try (429 rate limits, 408/409, 5xx, timeouts before the first
  token, connection errors, malformed bodies). ``retry_after`` is the wait the server asked for.
* ``GiveUp``: this one call failed and retrying it unchanged cannot help, but the next call
  may well succeed (a prompt the model cannot take, a request the server refused for its
  content). The loop records it as the call's error and goes on. ``ContextOverflow`` is the
  recognised kind of it: the prompt (or prompt + max_tokens) is larger than the model's window.
* ``BackendError`` (from ``base``): what every call would meet, so the run stops (stored,
  resumable): a rejected key, no access, an unknown model, an exhausted quota, a parameter
  the endpoint does not accept.

Context overflow bodies recognised (their figures parsed where given):

* OpenAI: ``code: context_length_exceeded``, "This model's maximum context length is N
  tokens. However, your messages resulted in M tokens" / "you requested T tokens (P in the
  messages, C in the completion)".
* vLLM: the same sentence ("This model's maximum context length is N tokens. However, you
  requested T tokens (P in the messages, C in the completion)" or "... your request has P
  input tokens"), and "'max_tokens' or 'max_completion_tokens' is too large: C. This model's
  maximum context length is N tokens and your request has P input tokens".
* SGLang: "The input (P tokens) is longer than the model's context length (N tokens)." and
  "Requested token count exceeds the model's maximum context length of N tokens. You
  requested a total of T tokens: P tokens from the input messages and C tokens for the
  completion."
* llama.cpp: ``type: exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx``
  ("request (P tokens) exceeds the available context size (N tokens), try increasing it").
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import openai

from agent.backends.base import BackendError
from agent.backends.openai_config import retry_after_seconds


class Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's requested wait, if any."""

    def __init__(self, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.retry_after = retry_after


class GiveUp(Exception):
    """A failure of this one call that retrying cannot mend, but that is no configuration error."""


class ContextOverflow(GiveUp):
    """The request does not fit the model's window; figures as the server stated them (None: not said)."""

    def __init__(self, message: str, window: Optional[int] = None, prompt_tokens: Optional[int] = None,
                 completion_tokens: Optional[int] = None):
        super().__init__(message)
        self.window = window
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class ParameterRejected(Transient):
    """The endpoint refused a parameter it has an alternative for (``max_tokens`` ->
    ``max_completion_tokens``, ``stream_options`` dropped); asked again at once without it."""

    def __init__(self, message: str, parameter: str):
        super().__init__(message, retry_after=0.0)
        self.parameter = parameter


@dataclass
class CallSite:
    """What an error message names: where the call went, which key, what was sent."""
    model: str
    base_url: str
    key_source: str
    sent: str                   # "temperature=..., max_tokens=..." as sent


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    """The error object of a refusal: ``{"error": {...}}`` unwrapped (the client does that) or the
    top-level object (vLLM and SGLang send ``{"object": "error", "message": ...}``)."""
    return dict(exc.body) if isinstance(exc.body, Mapping) else {}


def error_message(exc: openai.APIStatusError) -> str:
    msg = error_body(exc).get("message")
    return msg if isinstance(msg, str) and msg else str(exc)


def _int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


_WINDOW_PATTERNS = [
    re.compile(r"maximum context length is (\d+)"),
    re.compile(r"maximum context length of (\d+)"),
    re.compile(r"model's context length \((\d+) tokens\)"),
    re.compile(r"available context size \((\d+) tokens\)"),
    re.compile(r"context size \((\d+) tokens\)"),
]
_PROMPT_PATTERNS = [
    re.compile(r"\((\d+) in the messages"),
    re.compile(r"(\d+) tokens from the input messages"),
    re.compile(r"your request has (\d+) input tokens"),
    re.compile(r"your messages resulted in (\d+) tokens"),
    re.compile(r"the input \((\d+) tokens\)"),
    re.compile(r"request \((\d+) tokens\)"),
    re.compile(r"prompt contains at least (\d+) input tokens"),
]
_COMPLETION_PATTERNS = [
    re.compile(r"(\d+) in the completion"),
    re.compile(r"(\d+) tokens for the completion"),
    re.compile(r"is too large: (\d+)"),
]
_OVERFLOW_WORDS = ("context length", "context size", "context window", "context_length_exceeded",
                   "exceed_context_size", "maximum context")


def _first(patterns: list[re.Pattern], text: str) -> Optional[int]:
    for p in patterns:
        m = p.search(text)
        if m:
            return int(m.group(1))
    return None


def parse_overflow(status: int, body: Mapping[str, Any], message: str) -> Optional[ContextOverflow]:
    """A ``ContextOverflow`` when this refusal says the request exceeds the model's window."""
    if status not in (400, 413, 422):
        return None
    kind = f"{body.get('type') or ''} {body.get('code') or ''}".lower()
    low = message.lower()
    if not ("context_length_exceeded" in kind or "exceed_context_size" in kind
            or any(w in low for w in _OVERFLOW_WORDS)):
        return None
    window = _int(body.get("n_ctx")) or _first(_WINDOW_PATTERNS, low)
    prompt = _int(body.get("n_prompt_tokens")) or _first(_PROMPT_PATTERNS, low)
    completion = _first(_COMPLETION_PATTERNS, low)
    return ContextOverflow(message, window=window, prompt_tokens=prompt, completion_tokens=completion)


_PARAM_WORDS = ("unsupported parameter", "unsupported value", "unknown parameter", "unrecognized request argument",
                "extra inputs are not permitted", "extra_forbidden", "not supported with this model",
                "does not support", "invalid value for", "unexpected keyword")


def classify(exc: openai.APIStatusError, site: CallSite, token_param: str) -> Exception:
    """The exception the retry layer acts on for a refusal: ``Transient``, ``GiveUp``
    (``ContextOverflow``, ``ParameterRejected``) or ``BackendError``."""
    status = exc.status_code
    body = error_body(exc)
    msg = error_message(exc)
    low = msg.lower()
    where = f"OPENAI_BASE_URL={site.base_url}"
    if status == 429 and "quota" in f"{exc.code} {body.get('type')} {body.get('code')} {low}".lower():
        return BackendError(f"quota exhausted for the key from {site.key_source} at {where} "
                            f"(429: {msg}); add credit to that account or set OPENAI_API_KEY to another key")
    if status in (408, 409, 429) or status >= 500:
        return Transient(f"{where} answered {status}: {msg}", retry_after_seconds(exc.response.headers))
    if status == 401:
        return BackendError(f"{where} rejected the API key from {site.key_source} (401: {msg}); "
                            f"set OPENAI_API_KEY to a valid key for this endpoint")
    if status == 403:
        return BackendError(f"the key from {site.key_source} has no access to model {site.model!r} "
                            f"at {where} (403: {msg}); set OPENAI_API_KEY to a key with access, "
                            f"or choose another --model")
    if status == 404:
        return BackendError(f"model {site.model!r} not found at {where} (404: {msg}); check the "
                            f"name in --model openai:<model>, or set OPENAI_BASE_URL to the endpoint "
                            f"that serves it (requests go to {site.base_url}/chat/completions)")
    overflow = parse_overflow(status, body, msg)
    if overflow is not None:
        return overflow
    if status in (400, 422) and token_param == "max_tokens" and "max_completion_tokens" in msg:
        return ParameterRejected(f"model {site.model!r} wants max_completion_tokens instead of max_tokens; "
                                 "asking again with it", "max_tokens")
    if status in (400, 422) and "stream_options" in low:
        return ParameterRejected(f"{where} does not take stream_options; asking again without it", "stream_options")
    if status in (400, 422) and (any(w in low for w in _PARAM_WORDS)
                                     or body.get("param") not in (None, "", "messages")):
        return BackendError(f"{where} refused the request for model {site.model!r} ({status}: {msg}); "
                            f"check the options sent: {site.sent}")
    # Anything else refused this one request for its content: the call fails, the run goes on.
    return GiveUp(f"{where} refused this request for model {site.model!r} ({status}: {msg}); "
                  f"options sent: {site.sent}")
