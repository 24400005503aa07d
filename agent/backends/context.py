"""The model's window, its parallel slots, and counting a prompt's tokens.

Where the window comes from, first found wins:

1. ``context_tokens`` (option, ``--context-tokens``, or ``[openai]`` in the config file);
2. the server: llama.cpp's ``GET /props`` (``default_generation_settings.n_ctx``, which is the
   window of one slot, the server's ``-c`` divided by its ``--parallel``), vLLM's and SGLang's
   ``GET /v1/models`` (``max_model_len`` of the model's entry);
3. the first context-overflow refusal that states it (``errors.ContextOverflow.window``).

What was found is kept for the process (``KNOWN``, keyed by base URL and model), so the
critic's backend, built per critique, does not ask again and a learned window holds for the run.

Parallel requests: llama.cpp's ``/props`` says ``total_slots``; in-flight requests to one base
URL, proposals and critiques together, never exceed it (``limiter``). Servers that do not say
(vLLM, SGLang, Ollama, hosted APIs) queue what they cannot run; ``concurrency`` bounds ours.

Counting tokens without the model's tokenizer: the server's ``POST /tokenize`` where it
answers (llama.cpp: ``{"content"}`` -> ``{"tokens"}``; vLLM: ``{"model", "messages"}`` ->
``{"count"}``, the chat template applied), else an estimate of one token per
``chars_per_token`` (default 3) characters. The estimate is meant to count too many, never
too few: BPE vocabularies of current models average 3.5-4.5 characters a token on English
and code, small-vocabulary models about 3; counting too many only leaves part of the window
unused, counting too few gets the prompt refused or the answer cut by the window.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Optional

import openai

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD = 8          # tokens a chat template adds per message (role markers), counted generously
SAFETY_MARGIN = 16            # tokens kept free of prompt and answer


@dataclass
class Window:
    tokens: int
    source: str                  # "context_tokens" | "llama.cpp /props" | "/v1/models max_model_len" | "overflow error"


KNOWN: dict[tuple[str, str], Window] = {}
_KNOWN_LOCK = threading.Lock()


def known_window(base_url: str, model: str) -> Optional[Window]:
    with _KNOWN_LOCK:
        return KNOWN.get((base_url, model))


def remember_window(base_url: str, model: str, window: Window) -> None:
    with _KNOWN_LOCK:
        KNOWN[(base_url, model)] = window


def server_root(base_url: str) -> str:
    """``http://host:port`` for ``http://host:port/v1``: llama.cpp and vLLM serve /props and /tokenize there."""
    return base_url[:-3] if base_url.endswith("/v1") else base_url


# ---------------------------------------------------------------- parallel slots

class Limiter:
    """A semaphore whose size can shrink or grow (when a server says how many slots it has)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.in_flight = 0
        self._cond = threading.Condition()

    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            self.capacity = max(1, capacity)
            self._cond.notify_all()

    def acquire(self) -> None:
        with self._cond:
            while self.in_flight >= self.capacity:
                self._cond.wait()
            self.in_flight += 1

    def release(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()


_LIMITERS: dict[str, Limiter] = {}
_LIMITERS_LOCK = threading.Lock()


def limiter(base_url: str, capacity: int) -> Limiter:
    """The one limiter of requests to ``base_url`` in this process, sized ``capacity``."""
    with _LIMITERS_LOCK:
        lim = _LIMITERS.get(base_url)
        if lim is None:
            lim = _LIMITERS[base_url] = Limiter(capacity)
        else:
            lim.set_capacity(capacity)
        return lim


# ---------------------------------------------------------------- asking the server

@dataclass
class ServerFacts:
    window: Optional[Window] = None
    slots: Optional[int] = None               # llama.cpp total_slots
    tokenize: Optional[str] = None            # "llama.cpp" | "vllm" | None (estimate)


def _get(client: openai.OpenAI, url: str) -> Any:
    try:
        return client.get(url, cast_to=object)
    except (openai.APIError, ValueError) as exc:
        log.debug("GET %s: %s", url, exc)
        return None


def _post(client: openai.OpenAI, url: str, body: dict) -> Any:
    try:
        return client.post(url, body=body, cast_to=object)
    except (openai.APIError, ValueError) as exc:
        log.debug("POST %s: %s", url, exc)
        return None


def discover(client: openai.OpenAI, base_url: str, model: str, probe_tokenizer: bool = True) -> ServerFacts:
    """What the server says about its window, slots and tokenizer; nothing it does not say is guessed.
    ``client``: a short-timeout, no-retry client for the same endpoint."""
    facts = ServerFacts()
    root = server_root(base_url)
    props = _get(client, f"{root}/props")
    if isinstance(props, dict):
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        if isinstance(n_ctx, int) and n_ctx > 0:
            facts.window = Window(n_ctx, "llama.cpp /props")
        slots = props.get("total_slots")
        if isinstance(slots, int) and slots > 0:
            facts.slots = slots
    if facts.window is None:
        models = _get(client, f"{base_url}/models")
        entries = models.get("data") if isinstance(models, dict) else None
        if isinstance(entries, list):
            mine = [e for e in entries if isinstance(e, dict) and e.get("id") == model]
            if not mine and len(entries) == 1 and isinstance(entries[0], dict):
                mine = entries                      # one model served under another name
            n = mine[0].get("max_model_len") if mine else None
            if isinstance(n, int) and n > 0:
                facts.window = Window(n, "/v1/models max_model_len")
    if probe_tokenizer:
        got = _post(client, f"{root}/tokenize", {"content": "kernel"})
        if isinstance(got, dict) and isinstance(got.get("tokens"), list) and got["tokens"]:
            facts.tokenize = "llama.cpp"
        else:
            got = _post(client, f"{root}/tokenize",
                        {"model": model, "messages": [{"role": "user", "content": "kernel"}]})
            if isinstance(got, dict) and isinstance(got.get("count"), int):
                facts.tokenize = "vllm"
    return facts


# ---------------------------------------------------------------- counting

class TokenCounter:
    """Tokens of a message list: the server's count where it has a /tokenize, else the estimate."""

    def __init__(self, client: Optional[openai.OpenAI], base_url: str, model: str, how: Optional[str],
                 chars_per_token: float):
        self.client = client
        self.root = server_root(base_url)
        self.model = model
        self.how = how
        self.chars_per_token = chars_per_token
        self._cache: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @property
    def exact(self) -> bool:
        return self.how is not None

    def estimate(self, messages: list[dict[str, Any]]) -> int:
        text = sum(len(str(m.get("content") or "")) for m in messages)
        return math.ceil(text / self.chars_per_token) + MESSAGE_OVERHEAD * (len(messages) + 1)

    def count(self, messages: list[dict[str, Any]]) -> tuple[int, str]:
        """(tokens, how they were counted: "llama.cpp /tokenize" | "vllm /tokenize" | "estimate")."""
        key = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        result = self._server_count(messages) if self.how else None
        if result is None:
            result = (self.estimate(messages), f"estimate ({self.chars_per_token:g} characters a token)")
        with self._lock:
            self._cache[key] = result
        return result

    def _server_count(self, messages: list[dict[str, Any]]) -> Optional[tuple[int, str]]:
        if self.how == "vllm":
            got = _post(self.client, f"{self.root}/tokenize", {"model": self.model, "messages": messages})
            if isinstance(got, dict) and isinstance(got.get("count"), int):
                return got["count"], "vllm /tokenize"
            return None
        text = "\n".join(str(m.get("content") or "") for m in messages)
        got = _post(self.client, f"{self.root}/tokenize", {"content": text, "add_special": True})
        if isinstance(got, dict) and isinstance(got.get("tokens"), list):
            # /tokenize counts the contents; the chat template's markers are added on top.
            return len(got["tokens"]) + MESSAGE_OVERHEAD * (len(messages) + 1), "llama.cpp /tokenize"
        return None


# ---------------------------------------------------------------- the budget

@dataclass
class PromptBudget:
    """How many prompt tokens a call may carry. ``preferred`` leaves the answer its full share
    (``max_tokens``, at most half the window); ``hard`` leaves it only ``min_answer_tokens``:
    prompts are shortened to ``preferred`` and, if even the barest one is larger, sent as they
    are when within ``hard``, else refused."""
    window: int
    window_source: str
    preferred: int
    hard: int
    min_answer_tokens: int


def prompt_budget(window: Window, max_tokens: Optional[int], min_answer_tokens: int) -> PromptBudget:
    share = min(max_tokens or window.tokens // 2, window.tokens // 2)
    preferred = window.tokens - share - SAFETY_MARGIN
    hard = window.tokens - min_answer_tokens - SAFETY_MARGIN
    return PromptBudget(window=window.tokens, window_source=window.source, preferred=max(0, preferred),
                        hard=max(0, hard), min_answer_tokens=min_answer_tokens)


def answer_tokens(window: Optional[Window], prompt_tokens: int, max_tokens: Optional[int]) -> Optional[int]:
    """max_tokens to send: the configured one, lowered to what the window leaves the answer."""
    if window is None:
        return max_tokens or None
    room = window.tokens - prompt_tokens - SAFETY_MARGIN
    if not max_tokens:
        return None                           # 0: not sent (the server fills the window)
    return max(1, min(max_tokens, room))
