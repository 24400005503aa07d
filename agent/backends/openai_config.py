"""Settings of the ``openai:`` backend: defaults, the config file, and ``Retry-After``.

Settings, first found wins: the backend's options, the environment (``OPENAI_API_KEY``,
``OPENAI_BASE_URL``), the ``[openai]`` section of ``~/.config/kernelloop/config.toml``
(``KERNELLOOP_CONFIG`` names another file), then ``DEFAULTS``. ``timeout_s``, the name of
the one total timeout of earlier releases, is read as ``call_budget_s``.
"""
from __future__ import annotations

import email.utils
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from agent.backends.base import BackendError

try:
    import tomllib
except ModuleNotFoundError:       # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULTS: dict[str, Any] = {
    "temperature": None,          # None: not sent (the endpoint's default; some models accept no other)
    "max_tokens": 8192,           # 0: not sent; lowered per call to what the window leaves
    "context_tokens": None,       # the model's window; None: asked of the server, else learned from an overflow
    "min_answer_tokens": 256,     # a prompt that leaves the answer fewer than this fails (the task's error)
    "stream": True,               # stream answers (time limits per chunk, partial answers kept)
    "first_token_timeout_s": 600.0,  # from sending (once one of our slots is free) to the first chunk
    "stall_timeout_s": 120.0,     # the longest silence between two chunks of a streamed answer
    "call_budget_s": 1800.0,      # one call's total; past it the partial answer is kept, cut off (0: none)
    "max_retries": 5,             # retries after the first try
    "concurrency": 4,             # requests in flight at once; never more than the server's slots
    "reasoning_effort": None,     # passed through when set (low | medium | high ...)
    "count_tokens": "auto",       # auto: the server's /tokenize where it answers, else an estimate | estimate
    "chars_per_token": 3.0,       # the estimate: characters per token (conservative: most tokenizers average more)
    "backoff_initial_s": 1.0,     # first backoff; doubles per retry, plus up to 1 s of jitter
    "backoff_max_s": 60.0,
    "retry_after_max_s": 120.0,   # a longer Retry-After is waited for only this long
}
ALIASES = {"timeout_s": "call_budget_s", "max_concurrency": "concurrency"}
CONFIG_KEYS = {"api_key", "base_url", *DEFAULTS, *ALIASES}


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


def settings(given: Mapping[str, Any], section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each setting from the options (not None), else the file's section, else the default."""
    unknown = sorted(set(section) - CONFIG_KEYS)
    if unknown:
        raise BackendError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(CONFIG_KEYS))}")
    filed = {ALIASES.get(k, k): v for k, v in section.items()}
    out = {k: (given[k] if given.get(k) is not None else filed.get(k, DEFAULTS[k])) for k in DEFAULTS}
    for key in ("max_retries", "max_tokens", "min_answer_tokens"):
        if int(out[key]) < 0:
            raise BackendError(f"{key} must be >= 0, not {out[key]} (option or {where})")
    if out["context_tokens"] is not None and int(out["context_tokens"]) <= 0:
        out["context_tokens"] = None          # 0: ask the server
    if out["count_tokens"] not in ("auto", "estimate"):
        raise BackendError(f"count_tokens must be auto or estimate, not {out['count_tokens']!r} ({where})")
    return out


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
