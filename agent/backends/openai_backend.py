"""``openai:<model>``: any OpenAI-compatible chat-completions endpoint (hosted APIs, vLLM,
SGLang, llama.cpp's llama-server, Ollama).

Settings (``openai_config``: options, then ``OPENAI_API_KEY``/``OPENAI_BASE_URL``, then the
``[openai]`` section of ``~/.config/kernelloop/config.toml``, then the defaults)::

    [openai]
    api_key = "sk-..."
    base_url = "http://localhost:8000/v1"
    temperature = 0.7            # unset: not sent (the endpoint's default)
    max_tokens = 8192            # 0: not sent; lowered per call to what the window leaves
    context_tokens = 32768       # the model's window; unset: asked of the server, else learned
    min_answer_tokens = 256      # a prompt that leaves the answer less fails (that task's error)
    reasoning_effort = "high"    # unset: not sent
    stream = true
    first_token_timeout_s = 600  # to the first chunk (server queue + prompt processing)
    stall_timeout_s = 120        # the longest silence between chunks
    call_budget_s = 1800         # a call's total; past it the partial answer is kept, cut off (0: none)
    max_retries = 5              # retries after the first try
    concurrency = 4              # requests in flight at once; never more than the server's slots
    count_tokens = "auto"        # auto: the server's /tokenize where it answers | estimate

The window and parallel slots (``context``): asked of the server once (llama.cpp ``/props``,
vLLM/SGLang ``/v1/models``), or learned from the first overflow refusal, and kept for the
process. ``prompt_budget()`` tells the loop and the critic how many prompt tokens fit;
each call's ``max_tokens`` is lowered to what the window leaves the answer.

Failures (``errors.classify``): one retry layer (tenacity; the client's own retries are off)
for transient ones (429, 408/409, 5xx, connection errors, malformed bodies, no first chunk
within ``first_token_timeout_s``), waiting what ``Retry-After`` asks where sent. A failure of
this one request (a context overflow, a request refused for its content) comes back as
``Completion(error=...)`` and the run goes on; what every call would meet (rejected key, no
access, unknown model, exhausted quota, a parameter the endpoint refuses) raises
``BackendError`` and stops the run, which ``--resume`` continues. An overflow refusal that
states the window is learned from; when only the answer's share did not fit, the call is
asked again at once with max_tokens lowered.

Answers stream (``openai_stream``): a call that was receiving tokens is never retried for
being slow; past ``stall_timeout_s`` or ``call_budget_s`` its partial answer is kept, cut off.
A server that ignores ``stream`` and answers with a whole JSON completion is read as that
completion; from then on this backend asks without streaming (``stream_off``), says so once
(a line on stderr, the run's output) and keeps the words in ``run_notes``, which the loop stores
with the run; each call asked so records ``"stream": "off"`` in its context.
Reasoning returned apart from the answer (``reasoning_content``, ``reasoning``) or inside
``<think>`` is returned in ``Completion.reasoning`` and never in ``text``.
"""
from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from typing import Any, Mapping, Optional

import openai
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt

from agent.backends import context as ctx
from agent.backends.base import BackendError, register
from agent.backends.errors import CallSite, ContextOverflow, GiveUp, ParameterRejected, Transient, classify
from agent.backends.openai_config import (DEFAULT_BASE_URL, DEFAULTS, config_path, load_config,  # noqa: F401
                                          retry_after_seconds, settings)
from agent.backends.openai_stream import FirstTokenTimeout, Limits, StreamResult, completion_result, read_stream, \
    split_think
from agent.pricing import cost_usd, prices_from_config
from agent.types import Completion, ProposalRequest

log = logging.getLogger(__name__)

TRUNCATION_RATIO_EXACT = 0.9      # the server counted < 90% of an exact count: it cut the prompt
TRUNCATION_RATIO_ESTIMATE = 0.5   # ... < 50% of the (generous) estimate


class _Refit(Transient):
    """An overflow of the answer's share only: asked again at once with max_tokens lowered."""


@register("openai")
class OpenAIBackend:
    """Chat completions from an OpenAI-compatible endpoint; see the module docstring."""

    default_critic = "llm"

    def __init__(self, model: str, *, api_key: Optional[str] = None, base_url: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None, **options: Any):
        """``options``: any key of ``openai_config.DEFAULTS`` (None: from the file or the default);
        options meant for other backends (``store``...) are accepted and unused, so the loop
        can hand one option set to any backend."""
        if not model:
            raise BackendError("openai backend needs a model name: --model openai:<model>, e.g. openai:gpt-4o")
        self.model = model
        self.name = f"openai:{model}"
        cfg_all = load_config() if config is None else dict(config)
        self._config_where = f"[openai] of {config_path()}"
        given = {k: options.get(k) for k in DEFAULTS}
        if options.get("timeout_s") is not None and given["call_budget_s"] is None:
            given["call_budget_s"] = options["timeout_s"]
        s = settings(given, cfg_all.get("openai") or {}, self._config_where)
        try:
            self.extra_prices = prices_from_config(cfg_all.get("pricing") or {})
        except ValueError as exc:
            raise BackendError(f"{config_path()}: {exc}") from None
        self.temperature: Optional[float] = s["temperature"]
        self.max_tokens: int = int(s["max_tokens"])
        self.context_tokens: Optional[int] = int(s["context_tokens"]) if s["context_tokens"] else None
        self.min_answer_tokens = int(s["min_answer_tokens"])
        self.stream = bool(s["stream"])
        self.limits = Limits(first_token_s=float(s["first_token_timeout_s"]), stall_s=float(s["stall_timeout_s"]),
                             budget_s=float(s["call_budget_s"] or 0))
        self.max_retries = int(s["max_retries"])
        self.concurrency = max(1, int(s["concurrency"]))
        self.max_concurrency = self.concurrency
        self.reasoning_effort: Optional[str] = s["reasoning_effort"]
        self.count_tokens: str = s["count_tokens"]
        self.chars_per_token = float(s["chars_per_token"])
        self.backoff_initial_s = float(s["backoff_initial_s"])
        self.backoff_max_s = float(s["backoff_max_s"])
        self.retry_after_max_s = float(s["retry_after_max_s"])

        key, self._key_source = self._pick(api_key, "OPENAI_API_KEY", (cfg_all.get("openai") or {}).get("api_key"), "api_key")
        if not key:
            raise BackendError(f"no API key for {self.name}: set OPENAI_API_KEY "
                               f"(or api_key in {self._config_where}); a local server that checks none takes any, e.g. 'none'")
        url, self._url_source = self._pick(base_url, "OPENAI_BASE_URL", (cfg_all.get("openai") or {}).get("base_url"), "base_url")
        self.base_url = (url or DEFAULT_BASE_URL).rstrip("/")
        if not url:
            self._url_source = "the default (set OPENAI_BASE_URL for another endpoint)"
        self._key = key
        self.client = self._client()
        self._probe_client = openai.OpenAI(api_key=key, base_url=self.base_url, max_retries=0,
                                           timeout=openai.Timeout(10.0, connect=5.0))
        self._limiter = ctx.limiter(self.base_url, self.concurrency)
        self._facts: Optional[ctx.ServerFacts] = None
        self._facts_lock = threading.Lock()
        self._counter: Optional[ctx.TokenCounter] = None
        # OpenAI's reasoning models refuse max_tokens for max_completion_tokens; some servers
        # refuse stream_options. The first refusal switches these (errors.ParameterRejected).
        self.token_param = "max_tokens"
        self.stream_options = True
        self.stream_off: Optional[str] = None        # why this backend stopped streaming, once it did
        self.run_notes: list[str] = []               # said once in the run's output, stored with the run
        self._stream_lock = threading.Lock()

    def _client(self) -> openai.OpenAI:
        """The client for answers: streamed, a read timeout a little past the chunk limits; not
        streamed, ``call_budget_s`` (the whole answer comes at once)."""
        read = max(self.limits.first_token_s, self.limits.stall_s) + 5.0
        if not self.stream and self.limits.budget_s:
            read = self.limits.budget_s
        return openai.OpenAI(api_key=self._key, base_url=self.base_url, max_retries=0,
                             timeout=openai.Timeout(read, connect=10.0, write=60.0, pool=None))

    def _stop_streaming(self) -> None:
        """The server answered a streamed request with a whole completion: ask without streaming
        from now on (the answer itself was read, nothing is lost); said once."""
        with self._stream_lock:
            if not self.stream:
                return
            self.stream_off = (f"{self.base_url} answered a streamed request with a whole completion (it does not "
                               f"stream): asking without streaming for the rest of the run (stream = false in "
                               f"{self._config_where} says so from the start)")
            self.stream = False
            self.client = self._client()
            self.run_notes.append(self.stream_off)
        # Said on the run's output itself (not a log record a handler may swallow), once.
        print(f"[kernelloop] {self.name}: {self.stream_off}", file=sys.stderr, flush=True)

    def _pick(self, option: Optional[str], env: str, from_file: Optional[str], file_key: str) -> tuple[Optional[str], str]:
        if option:
            return option, f"the {file_key} option"
        if os.environ.get(env):
            return os.environ[env], env
        if from_file:
            return str(from_file), f"{file_key} in {self._config_where}"
        return None, ""

    # ------------------------------------------------------------------ window and slots

    def server_facts(self) -> ctx.ServerFacts:
        """What the server says of its window, slots and tokenizer (asked once per backend)."""
        with self._facts_lock:
            if self._facts is None:
                probe = self.count_tokens == "auto"
                if self.context_tokens is not None and not probe:
                    facts = ctx.ServerFacts()
                else:
                    facts = ctx.discover(self._probe_client, self.base_url, self.model, probe_tokenizer=probe)
                if facts.window is not None and ctx.known_window(self.base_url, self.model) is None:
                    ctx.remember_window(self.base_url, self.model, facts.window)
                if facts.slots:
                    self.max_concurrency = min(self.concurrency, facts.slots)
                    self._limiter.set_capacity(self.max_concurrency)
                    log.info("%s: the server runs %d requests at once; in flight at most %d",
                             self.name, facts.slots, self.max_concurrency)
                self._counter = ctx.TokenCounter(self._probe_client, self.base_url, self.model, facts.tokenize,
                                                 self.chars_per_token)
                self._facts = facts
            return self._facts

    def window(self) -> Optional[ctx.Window]:
        """The model's window: ``context_tokens``, else what the server said or an overflow taught."""
        if self.context_tokens is not None:
            return ctx.Window(self.context_tokens, "context_tokens")
        self.server_facts()
        return ctx.known_window(self.base_url, self.model)

    def prompt_budget(self) -> Optional[ctx.PromptBudget]:
        """How many prompt tokens a call may carry; None while the window is unknown."""
        w = self.window()
        return ctx.prompt_budget(w, self.max_tokens, self.min_answer_tokens) if w is not None else None

    def count_prompt(self, messages: list[dict[str, Any]]) -> tuple[int, str]:
        """(tokens, how counted) of ``messages`` as this backend counts them."""
        self.server_facts()
        assert self._counter is not None
        return self._counter.count(messages)

    # ------------------------------------------------------------------ calls

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        return self.chat(request.messages, purpose="propose")

    def chat(self, messages: list[dict[str, str]], purpose: str = "critique") -> Completion:
        """One chat completion with retries. Failures of this call come back as
        ``Completion(error=...)``; what every call would meet raises ``BackendError``."""
        start = time.monotonic()
        prompt_count, counted_by = self.count_prompt(messages)
        window = self.window()
        info: dict[str, Any] = {"prompt_count": prompt_count, "counted_by": counted_by,
                                "window": window.tokens if window else None,
                                "window_source": window.source if window else None}
        if window is not None and prompt_count > window.tokens - self.min_answer_tokens - ctx.SAFETY_MARGIN:
            return self._failed(self._too_large(prompt_count, counted_by, window), start, info, overflow=True)
        state = {"max_tokens": ctx.answer_tokens(window, prompt_count, self.max_tokens), "refit": False, "tries": 0}

        def once() -> Completion:
            state["tries"] += 1
            info["max_tokens_sent"] = state["max_tokens"]
            try:
                return self._request(messages, state["max_tokens"])
            except ParameterRejected as exc:
                if exc.parameter == "max_tokens":
                    self.token_param = "max_completion_tokens"
                elif exc.parameter == "stream_options":
                    self.stream_options = False
                raise
            except ContextOverflow as exc:
                raise self._after_overflow(exc, prompt_count, state, info) from None

        retrying = Retrying(stop=stop_after_attempt(self.max_retries + 1), wait=self._wait,
                            retry=retry_if_exception_type(Transient), reraise=True,
                            before_sleep=self._log_retry(purpose))
        try:
            completion = retrying(once)
        except Transient as exc:
            tries = state["tries"]
            return self._failed(f"{exc} (gave up after {tries} tr{'y' if tries == 1 else 'ies'})", start, info)
        except ContextOverflow as exc:
            return self._failed(str(exc), start, info, overflow=True)
        except GiveUp as exc:
            return self._failed(str(exc), start, info)
        completion.latency_s = time.monotonic() - start
        self._judge(completion, prompt_count, info)
        return completion

    def _too_large(self, prompt_count: int, counted_by: str, window: ctx.Window) -> str:
        return (f"the prompt is {prompt_count} tokens ({counted_by}) and model {self.model!r} has a window of "
                f"{window.tokens} tokens ({window.source}); at least {self.min_answer_tokens} must be left for "
                f"the answer (min_answer_tokens)")

    def _after_overflow(self, exc: ContextOverflow, prompt_count: int, state: dict, info: dict) -> Exception:
        """Learn the window an overflow states; ask again at once when only the answer's share was too large."""
        if exc.window:
            learned = ctx.Window(exc.window, "overflow error")
            current = ctx.known_window(self.base_url, self.model)
            if self.context_tokens is None and (current is None or current.tokens != exc.window):
                ctx.remember_window(self.base_url, self.model, learned)
                log.warning("%s: the server's window is %d tokens (learned from its refusal; set "
                            "context_tokens to say so up front)", self.name, exc.window)
            info["window"], info["window_source"] = exc.window, (self.window() or learned).source
            prompt = exc.prompt_tokens or prompt_count
            room = exc.window - prompt - ctx.SAFETY_MARGIN
            lowered = min(self.max_tokens or room, room)
            if not state["refit"] and room >= self.min_answer_tokens and lowered < (state["max_tokens"] or room + 1):
                state["refit"] = True
                state["max_tokens"] = lowered
                return _Refit(f"the answer's share did not fit the window of {exc.window} tokens; "
                              f"asking again with max_tokens={state['max_tokens']}", retry_after=0.0)
        sizes = ", ".join(f"{k} {v}" for k, v in (("prompt", exc.prompt_tokens), ("window", exc.window),
                                                  ("answer", exc.completion_tokens)) if v)
        return ContextOverflow(f"the prompt is too long for model {self.model!r} ({sizes or 'sizes not stated'}; "
                               f"our count {prompt_count}): {exc}", exc.window, exc.prompt_tokens, exc.completion_tokens)

    def _failed(self, message: str, start: float, info: dict, overflow: bool = False) -> Completion:
        return Completion(text="", model=self.name, error=message, latency_s=time.monotonic() - start,
                          finish_cause="error", context=dict(info), overflow=overflow)

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

    def _site(self, max_tokens: Optional[int]) -> CallSite:
        sent = f"temperature={self.temperature}, {self.token_param}={max_tokens}"
        if self.reasoning_effort:
            sent += f", reasoning_effort={self.reasoning_effort}"
        return CallSite(model=self.model, base_url=self.base_url, key_source=self._key_source, sent=sent)

    def _params(self, messages: list[dict[str, str]], max_tokens: Optional[int]) -> dict[str, Any]:
        params: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if max_tokens:
            params[self.token_param] = max_tokens
        if self.reasoning_effort:
            params["reasoning_effort"] = self.reasoning_effort
        if self.stream:
            params["stream"] = True
            if self.stream_options:
                params["stream_options"] = {"include_usage": True}
        return params

    def _request(self, messages: list[dict[str, str]], max_tokens: Optional[int]) -> Completion:
        params = self._params(messages, max_tokens)
        streamed = bool(params.get("stream"))
        try:
            if streamed:
                self._limiter.acquire()
                got = read_stream(lambda: self.client.chat.completions.create(**params), self.limits,
                                  self._limiter.release)
            else:
                self._limiter.acquire()
                try:
                    got = self._plain(params)
                finally:
                    self._limiter.release()
        except openai.APIStatusError as exc:
            raise classify(exc, self._site(max_tokens), self.token_param) from None
        except FirstTokenTimeout as exc:
            raise Transient(f"{self.base_url}: {exc}") from None
        except openai.APITimeoutError:
            raise Transient(f"no answer from {self.base_url} within the client's timeout "
                            f"(first_token_timeout_s / call_budget_s)") from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise Transient(f"cannot reach OPENAI_BASE_URL={self.base_url} ({self._url_source}): "
                            f"{type(cause).__name__}: {cause}") from None
        except (ValueError, openai.APIResponseValidationError, openai.APIError) as exc:
            raise Transient(f"malformed response from {self.base_url}: {type(exc).__name__}: {exc}") from None
        if got.whole:
            self._stop_streaming()
        if got.chunks == 0 and not got.finish_reason and not got.text:
            raise Transient(f"malformed response from {self.base_url}: an empty stream")
        text, think = split_think(got.text)
        reasoning = "\n\n".join(r for r in (got.reasoning.strip(), think) if r) or None
        finish_reason = got.finish_reason
        if got.ended_by:
            finish_reason = "length"                      # cut off: parsed as a truncated answer
            log.warning("%s: %s; the partial answer (%d characters) is kept as cut off", self.name, got.note, len(text))
        return Completion(text=text, model=self.name, finish_reason=finish_reason,
                          prompt_tokens=got.prompt_tokens, completion_tokens=got.completion_tokens,
                          cost_usd=cost_usd(self.model, got.prompt_tokens, got.completion_tokens, self.extra_prices),
                          reasoning=reasoning, reasoning_tokens=got.reasoning_tokens,
                          finish_cause=got.ended_by,
                          context={**({"ended": got.note} if got.note else {}),
                                   **({"stream": "off"} if self.stream_off and (got.whole or not streamed) else {})})

    def _plain(self, params: dict[str, Any]) -> StreamResult:
        """One non-streamed answer (``stream = false``): one total timeout, ``call_budget_s``."""
        return completion_result(self.client.chat.completions.create(**params))

    def _judge(self, c: Completion, prompt_count: int, info: dict[str, Any]) -> None:
        """The finish cause, the truncated-prompt flag and the context record of a completed call."""
        c.context = {**info, **c.context}
        window = info.get("window")
        sent = info.get("max_tokens_sent")
        p, n = c.prompt_tokens, c.completion_tokens
        if c.finish_cause is None:
            if c.finish_reason == "length":
                if sent and n is not None and n >= sent:
                    c.finish_cause = "max_tokens"
                elif window and p is not None and n is not None and p + n >= window - 2:
                    c.finish_cause = "window"
                elif not sent:
                    c.finish_cause = "window"
                else:
                    c.finish_cause = "max_tokens" if n is None else "length"
            elif c.finish_reason in (None, "stop", "eos"):
                c.finish_cause = "stop"
            else:
                c.finish_cause = c.finish_reason
        exact = self._counter is not None and self._counter.exact
        ratio = TRUNCATION_RATIO_EXACT if exact else TRUNCATION_RATIO_ESTIMATE
        if p is not None and prompt_count and p < ratio * prompt_count:
            c.prompt_truncated = True
            log.warning("%s: the server counted %d prompt tokens of the %d sent (%s): it cut the prompt "
                        "(set the server's window, e.g. Ollama's num_ctx, or context_tokens)",
                        self.name, p, prompt_count, info.get("counted_by"))
