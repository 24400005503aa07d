"""``openai:<model>``: any OpenAI-compatible chat-completions endpoint.

Settings, first found wins: the backend's options (``api_key``, ``base_url``), the
environment (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``), the ``[openai]`` section of
``~/.config/kernelloop/config.toml`` (``KERNELLOOP_CONFIG`` names another file)::

    [openai]
    api_key = "sk-..."
    base_url = "http://localhost:8000/v1"
    temperature = 0.7          # unset: not sent (the endpoint's default)
    max_tokens = 8192          # 0: not sent
    timeout_s = 300            # per request
    max_retries = 5            # retries after the first try
    concurrency = 4            # requests in flight at once (also ``max_concurrency``)

Options given to the backend (``get_backend("openai:gpt-4o", temperature=0.2, ...)``) win
over the file; an option left ``None`` falls back to it, then to the defaults below.

One retry layer: the openai client's own retries are off (``max_retries=0``) and tenacity
retries transient failures (429 rate limits, 408/409, 5xx, timeouts, connection errors,
malformed response bodies) with exponential backoff and jitter, waiting what a
``Retry-After`` (or ``retry-after-ms``) header asks instead when the server sends one.
Failures that a retry cannot mend fail at once with ``BackendError`` and a message naming
what to fix: a rejected key (401), no permission (403), an unknown model or wrong base
URL (404), an exhausted quota (429 ``insufficient_quota``), an invalid request (400/422).
A transient failure that outlasts the retries (and a prompt too long for the model's
context) is returned as ``Completion(error=...)`` so the loop records it and goes on.
A model that refuses ``max_tokens`` for ``max_completion_tokens`` (OpenAI's reasoning
models) is asked again with that name, and keeps it.
"""
from __future__ import annotations

import email.utils
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import openai
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt

from agent.backends.base import BackendError, register
from agent.pricing import cost_usd, prices_from_config
from agent.types import Completion, ProposalRequest

try:
    import tomllib
except ModuleNotFoundError:       # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULTS: dict[str, Any] = {
    "temperature": None,          # None: not sent (the endpoint's default; some models accept no other)
    "max_tokens": 8192,           # 0: not sent
    "timeout_s": 300.0,
    "max_retries": 5,             # retries after the first try
    "concurrency": 4,
    "backoff_initial_s": 1.0,     # first backoff; doubles per retry, plus up to 1 s of jitter
    "backoff_max_s": 60.0,
    "retry_after_max_s": 120.0,   # a longer Retry-After is waited for only this long
}
CONFIG_KEYS = {"api_key", "base_url", *DEFAULTS}


def config_path() -> Path:
    explicit = os.environ.get("KERNELLOOP_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(root) / "kernelloop" / "config.toml"


def load_config(path: Optional[Path] = None) -> dict[str, Any]:
    """The whole config file as a dict ({} when there is none)."""
    path = path or config_path()
    if not path.is_file():
        return {}
    if tomllib is None:
        raise BackendError(f"reading {path} needs Python 3.11+ (tomllib) or the tomli package")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BackendError(f"config file {path} cannot be read: {exc}") from None


def retry_after_seconds(headers: Optional[Mapping[str, str]], now: Optional[float] = None) -> Optional[float]:
    """The wait a response asks for: ``retry-after-ms``, or ``Retry-After`` in seconds or as an HTTP date."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's requested wait, if any."""

    def __init__(self, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.retry_after = retry_after


class _GiveUp(Exception):
    """A failure of this one call that retrying cannot mend, but that is no configuration error."""


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, Mapping):
        msg = body.get("message")
        if isinstance(msg, str) and msg:
            return msg
    return str(exc)


def _is_quota(exc: openai.APIStatusError) -> bool:
    body = exc.body if isinstance(exc.body, Mapping) else {}
    marks = " ".join(str(x) for x in (exc.code, body.get("type"), body.get("code"), _error_message(exc)) if x)
    return "quota" in marks.lower()


@register("openai")
class OpenAIBackend:
    """Chat completions from an OpenAI-compatible endpoint; see the module docstring."""

    default_critic = "llm"

    def __init__(self, model: str, *, api_key: Optional[str] = None, base_url: Optional[str] = None,
                 temperature: Optional[float] = None, max_tokens: Optional[int] = None,
                 timeout_s: Optional[float] = None, max_retries: Optional[int] = None,
                 concurrency: Optional[int] = None, backoff_initial_s: Optional[float] = None,
                 backoff_max_s: Optional[float] = None, retry_after_max_s: Optional[float] = None,
                 config: Optional[Mapping[str, Any]] = None, **_ignored: Any):
        """``**_ignored``: options meant for other backends (``store``...) are accepted and unused,
        so the loop can hand one option set to any backend."""
        if not model:
            raise BackendError("openai backend needs a model name: --model openai:<model>, e.g. openai:gpt-4o")
        self.model = model
        self.name = f"openai:{model}"
        cfg_all = load_config() if config is None else dict(config)
        section = cfg_all.get("openai") or {}
        self._config_where = f"[openai] of {config_path()}"
        unknown = sorted(set(section) - CONFIG_KEYS)
        if unknown:
            raise BackendError(f"{self._config_where}: unknown setting(s) {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(CONFIG_KEYS))}")
        try:
            self.extra_prices = prices_from_config(cfg_all.get("pricing") or {})
        except ValueError as exc:
            raise BackendError(f"{config_path()}: {exc}") from None

        given = {"temperature": temperature, "max_tokens": max_tokens, "timeout_s": timeout_s,
                 "max_retries": max_retries, "concurrency": concurrency,
                 "backoff_initial_s": backoff_initial_s, "backoff_max_s": backoff_max_s,
                 "retry_after_max_s": retry_after_max_s}
        settings = {k: (given[k] if given[k] is not None else section.get(k, DEFAULTS[k])) for k in DEFAULTS}
        self.temperature: Optional[float] = settings["temperature"]
        self.max_tokens: Optional[int] = settings["max_tokens"]
        self.timeout_s = float(settings["timeout_s"])
        self.max_retries = int(settings["max_retries"])
        self.max_concurrency = max(1, int(settings["concurrency"]))
        self.backoff_initial_s = float(settings["backoff_initial_s"])
        self.backoff_max_s = float(settings["backoff_max_s"])
        self.retry_after_max_s = float(settings["retry_after_max_s"])
        if self.max_retries < 0:
            raise BackendError(f"max_retries must be >= 0, not {self.max_retries}")

        key, self._key_source = self._pick(api_key, "OPENAI_API_KEY", section.get("api_key"), "api_key")
        if not key:
            raise BackendError(f"no API key for {self.name}: set OPENAI_API_KEY "
                               f"(or api_key in {self._config_where})")
        url, self._url_source = self._pick(base_url, "OPENAI_BASE_URL", section.get("base_url"), "base_url")
        self.base_url = (url or DEFAULT_BASE_URL).rstrip("/")
        if not url:
            self._url_source = "the default (set OPENAI_BASE_URL for another endpoint)"
        self.client = openai.OpenAI(api_key=key, base_url=self.base_url, timeout=self.timeout_s, max_retries=0)
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        # OpenAI's reasoning models refuse max_tokens and want max_completion_tokens; the first
        # refusal switches this (see _classify), other endpoints keep the widely known name.
        self.token_param = "max_tokens"

    def _pick(self, option: Optional[str], env: str, from_file: Optional[str], file_key: str) -> tuple[Optional[str], str]:
        if option:
            return option, f"the {file_key} option"
        if os.environ.get(env):
            return os.environ[env], env
        if from_file:
            return str(from_file), f"{file_key} in {self._config_where}"
        return None, ""

    # ------------------------------------------------------------------ calls

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        return self.chat(request.messages, purpose="propose")

    def chat(self, messages: list[dict[str, str]], purpose: str = "critique") -> Completion:
        """One chat completion with retries. Transient failures that outlast the retries come
        back as ``Completion(error=...)``; configuration errors raise ``BackendError``."""
        start = time.monotonic()
        tries = 0

        def once() -> Completion:
            nonlocal tries
            tries += 1
            return self._request(messages)

        retrying = Retrying(stop=stop_after_attempt(self.max_retries + 1), wait=self._wait,
                            retry=retry_if_exception_type(_Transient), reraise=True,
                            before_sleep=self._log_retry(purpose))
        try:
            completion = retrying(once)
        except _Transient as exc:
            return self._failed(f"{exc} (gave up after {tries} tr{'y' if tries == 1 else 'ies'})", start)
        except _GiveUp as exc:
            return self._failed(str(exc), start)
        completion.latency_s = time.monotonic() - start
        return completion

    def _failed(self, message: str, start: float) -> Completion:
        return Completion(text="", model=self.name, error=message, latency_s=time.monotonic() - start)

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        asked = getattr(exc, "retry_after", None)
        if asked is not None:
            return min(asked, self.retry_after_max_s)
        backoff = self.backoff_initial_s * 2 ** (state.attempt_number - 1)
        return min(self.backoff_max_s, backoff + random.uniform(0, min(1.0, self.backoff_initial_s)))

    def _log_retry(self, purpose: str):
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s (%s): %s; retry %d of %d in %.1f s", self.name, purpose, exc,
                        state.attempt_number, self.max_retries, state.next_action.sleep if state.next_action else 0)
        return before_sleep

    def _request(self, messages: list[dict[str, str]]) -> Completion:
        params: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.max_tokens:
            params[self.token_param] = self.max_tokens
        try:
            with self._slots:
                raw = self.client.chat.completions.with_raw_response.create(**params)
                response = raw.parse()
        except openai.APIStatusError as exc:
            raise self._classify(exc) from None
        except openai.APITimeoutError:
            raise _Transient(f"no answer from {self.base_url} within {self.timeout_s:g} s "
                             f"(timeout_s)") from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise _Transient(f"cannot reach OPENAI_BASE_URL={self.base_url} ({self._url_source}): "
                             f"{type(cause).__name__}: {cause}") from None
        except (ValueError, openai.APIResponseValidationError) as exc:   # JSONDecodeError is a ValueError
            raise _Transient(f"malformed response from {self.base_url}: {type(exc).__name__}: {exc}") from None

        choices = getattr(response, "choices", None)
        if not choices:
            raise _Transient(f"malformed response from {self.base_url}: no choices in "
                             f"{str(response)[:200]!r}")
        choice = choices[0]
        usage = getattr(response, "usage", None)
        prompt_tokens = getattr(usage, "prompt_tokens", None) if usage else None
        completion_tokens = getattr(usage, "completion_tokens", None) if usage else None
        text = (choice.message.content if choice.message else None) or ""
        return Completion(text=text, model=self.name, finish_reason=choice.finish_reason,
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          cost_usd=cost_usd(self.model, prompt_tokens, completion_tokens, self.extra_prices))

    def _classify(self, exc: openai.APIStatusError) -> Exception:
        """The exception the retry layer acts on: _Transient, _GiveUp or BackendError."""
        status = exc.status_code
        msg = _error_message(exc)
        where = f"OPENAI_BASE_URL={self.base_url}"
        if status == 429 and _is_quota(exc):
            return BackendError(f"quota exhausted for the key from {self._key_source} at {where} "
                                f"(429: {msg}); add credit to that account or set OPENAI_API_KEY to another key")
        if status in (408, 409, 429) or status >= 500:
            return _Transient(f"{where} answered {status}: {msg}", retry_after_seconds(exc.response.headers))
        if status == 401:
            return BackendError(f"{where} rejected the API key from {self._key_source} (401: {msg}); "
                                f"set OPENAI_API_KEY to a valid key for this endpoint")
        if status == 403:
            return BackendError(f"the key from {self._key_source} has no access to model {self.model!r} "
                                f"at {where} (403: {msg}); set OPENAI_API_KEY to a key with access, "
                                f"or choose another --model")
        if status == 404:
            return BackendError(f"model {self.model!r} not found at {where} (404: {msg}); check the "
                                f"name in --model openai:<model>, or set OPENAI_BASE_URL to the endpoint "
                                f"that serves it (requests go to {self.base_url}/chat/completions)")
        if (status == 400 and self.max_tokens and self.token_param == "max_tokens"
                and "max_completion_tokens" in msg):
            self.token_param = "max_completion_tokens"
            return _Transient(f"model {self.model!r} wants max_completion_tokens instead of max_tokens; "
                              "asking again with it", retry_after=0.0)
        if status == 400 and ("context" in msg.lower() and ("length" in msg.lower() or "window" in msg.lower())
                              or str(exc.code) == "context_length_exceeded"):
            return _GiveUp(f"the prompt is too long for model {self.model!r} (400: {msg})")
        return BackendError(f"{where} refused the request for model {self.model!r} ({status}: {msg}); "
                            f"check the options sent: temperature={self.temperature}, "
                            f"max_tokens={self.max_tokens}")
