"""A real HTTP server that speaks OpenAI chat completions from a script, for tests.

``FakeOpenAI`` listens on 127.0.0.1 (an ephemeral port) in a thread and answers
``POST /v1/chat/completions`` (and ``/chat/completions``) with the next scripted
response: a completion (text, finish_reason, usage, optional delay) or an injected fault
(429 with Retry-After, 500/503, a slow answer, a malformed JSON body, 401, 404 model not
found, 429 insufficient_quota, the context-overflow refusals of OpenAI, vLLM, SGLang and
llama.cpp, a silently truncated prompt, a stream that stalls). A request with
``"stream": true`` is answered as server-sent events, chunk by chunk (reasoning apart from
the content when scripted); with ``streams = False`` the server never streams (it answers
every request with a whole JSON completion, as simple servers and some proxies do). ``props``, ``models`` and ``tokenize`` make it answer llama.cpp's
``GET /props``, ``GET /v1/models`` (vLLM, SGLang) and ``POST /tokenize``; those requests are
recorded in ``probes``, chat completions in ``requests``. With the script exhausted it answers 418 with a message
saying so. Every request is recorded (path, headers, JSON body, arrival time).

The ``fake_openai`` fixture starts one per test, points ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` at it (and ``KERNELLOOP_CONFIG`` at a file that does not exist, so a
developer's own config is never read), and stops it afterwards.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import pytest


@dataclass
class Scripted:
    status: int = 200
    body: Any = None                    # dict (sent as JSON), bytes (sent as is) or None (a completion)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    text: str = ""
    finish_reason: str = "stop"
    usage: Optional[tuple[int, int]] = (11, 22)
    model: Optional[str] = None
    reasoning: str = ""                 # sent apart from the content, under ``reasoning_field``
    reasoning_field: str = "reasoning_content"
    reasoning_tokens: Optional[int] = None
    chunk_chars: int = 16               # streamed: characters of text per chunk
    chunk_delay_s: float = 0.0          # streamed: pause between chunks
    stall_after: Optional[int] = None   # streamed: fall silent after this many chunks ...
    stall_s: float = 0.0                # ... for this long (then end without [DONE])
    gate: Optional[threading.Event] = None  # answered only once this is set (the test says when)


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: Any                           # parsed JSON, or the raw text when it is not JSON
    at: float                           # time.monotonic() on arrival
    status: int = 0                     # what it was answered with


def _error(message: str, type_: str, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class FakeOpenAI:
    def __init__(self, max_lifetime_s: float = 300.0) -> None:
        """``max_lifetime_s``: the server stops itself after this long, even if never closed."""
        self._script: deque[Scripted] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.requests: list[RecordedRequest] = []   # chat completions
        self.probes: list[RecordedRequest] = []     # GET /props, /v1/models; POST /tokenize
        self._counter = 0
        self.in_flight = 0
        self.max_in_flight = 0              # the most requests it was answering at once
        self.props: Optional[dict] = None          # GET /props (llama.cpp); None: 404
        self.models: Optional[list[dict]] = None   # GET /v1/models entries; None: 404
        self.tokenize: Optional[str] = None        # POST /tokenize: "llama.cpp" | "vllm" | None (404)
        self.chars_per_token = 4                   # how the fake tokenizer counts
        self.streams = True                        # False: "stream": true is ignored (a whole JSON completion)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-openai", daemon=True)
        self._thread.start()
        self._reaper = threading.Timer(max_lifetime_s, self.close)
        self._reaper.daemon = True
        self._reaper.start()

    # ----------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._reaper.cancel()
        self._stop.set()                # wakes slow answers
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FakeOpenAI":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- script

    def push(self, item: Scripted) -> "FakeOpenAI":
        with self._lock:
            self._script.append(item)
        return self

    def reply(self, text: str, finish_reason: str = "stop", usage: Optional[tuple[int, int]] = (11, 22),
              delay_s: float = 0.0, model: Optional[str] = None,
              gate: Optional[threading.Event] = None) -> "FakeOpenAI":
        """A completion; ``usage`` is (prompt_tokens, completion_tokens), None for no usage field;
        with a ``gate``, held (in flight) until the test sets it."""
        return self.push(Scripted(text=text, finish_reason=finish_reason, usage=usage, delay_s=delay_s, model=model,
                                  gate=gate))

    def truncated(self, text: str, usage: tuple[int, int] = (11, 4096)) -> "FakeOpenAI":
        """A completion cut off at max_tokens (finish_reason=length)."""
        return self.reply(text, finish_reason="length", usage=usage)

    def slow(self, delay_s: float, text: str = "too late") -> "FakeOpenAI":
        """A completion that arrives only after ``delay_s`` (past a short client timeout)."""
        return self.reply(text, delay_s=delay_s)

    def rate_limited(self, retry_after: Optional[str] = "1", retry_after_ms: Optional[str] = None) -> "FakeOpenAI":
        headers = {}
        if retry_after is not None:
            headers["Retry-After"] = retry_after
        if retry_after_ms is not None:
            headers["retry-after-ms"] = retry_after_ms
        return self.push(Scripted(status=429, headers=headers, body=_error(
            "Rate limit reached for requests per min. Please try again later.", "requests", "rate_limit_exceeded")))

    def server_error(self, status: int = 500) -> "FakeOpenAI":
        message = {500: "The server had an error while processing your request.",
                   502: "Bad gateway.", 503: "The engine is currently overloaded, please try again later."}
        return self.push(Scripted(status=status, body=_error(message.get(status, "server error"), "server_error")))

    def malformed(self) -> "FakeOpenAI":
        """A 200 whose JSON body is cut short."""
        return self.push(Scripted(status=200, body=b'{"id": "chatcmpl-broken", "choices": [{"index": 0, "mess',
                                  headers={"Content-Type": "application/json"}))

    def unauthorized(self) -> "FakeOpenAI":
        return self.push(Scripted(status=401, body=_error(
            "Incorrect API key provided: sk-fake***. You can find your API key at "
            "https://platform.openai.com/account/api-keys.", "invalid_request_error", "invalid_api_key")))

    def model_not_found(self, model: str = "no-such-model") -> "FakeOpenAI":
        return self.push(Scripted(status=404, body=_error(
            f"The model `{model}` does not exist or you do not have access to it.",
            "invalid_request_error", "model_not_found")))

    def quota_exceeded(self) -> "FakeOpenAI":
        return self.push(Scripted(status=429, body=_error(
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota", "insufficient_quota")))

    def bad_request(self, message: str, code: Optional[str] = None) -> "FakeOpenAI":
        return self.push(Scripted(status=400, body=_error(message, "invalid_request_error", code)))

    # Context overflow refusals, as each server words them (see agent/backends/errors.py).
    def overflow_openai(self, window: int, prompt: int) -> "FakeOpenAI":
        return self.push(Scripted(status=400, body=_error(
            f"This model's maximum context length is {window} tokens. However, your messages resulted in "
            f"{prompt} tokens. Please reduce the length of the messages.", "invalid_request_error",
            "context_length_exceeded")))

    def overflow_vllm(self, window: int, prompt: int, completion: int) -> "FakeOpenAI":
        return self.push(Scripted(status=400, body={"error": {
            "message": f"This model's maximum context length is {window} tokens. However, you requested "
                       f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
                       f"Please reduce the length of the messages or completion.",
            "type": "BadRequestError", "param": None, "code": 400}}))

    def overflow_sglang(self, window: int, prompt: int, completion: Optional[int] = None) -> "FakeOpenAI":
        if completion is None:
            msg = f"The input ({prompt} tokens) is longer than the model's context length ({window} tokens)."
        else:
            msg = (f"Requested token count exceeds the model's maximum context length of {window} tokens. "
                   f"You requested a total of {prompt + completion} tokens: {prompt} tokens from the input "
                   f"messages and {completion} tokens for the completion. Please reduce the number of tokens "
                   f"in the input messages or the completion to fit within the limit.")
        return self.push(Scripted(status=400, body={"object": "error", "message": msg, "type": "BadRequest",
                                                    "param": None, "code": 400}))

    def overflow_llamacpp(self, window: int, prompt: int) -> "FakeOpenAI":
        return self.push(Scripted(status=400, body={"error": {
            "code": 400, "message": f"request ({prompt} tokens) exceeds the available context size "
                                    f"({window} tokens), try increasing it",
            "type": "exceed_context_size_error", "n_prompt_tokens": prompt, "n_ctx": window}}))

    def silently_truncating(self, text: str, kept_prompt_tokens: int, completion: int = 50) -> "FakeOpenAI":
        """Ollama beyond num_ctx: answers, but counted (and read) only the prompt's last tokens."""
        return self.reply(text, usage=(kept_prompt_tokens, completion))

    def stalling(self, text: str, after_chunks: int, stall_s: float, chunk_chars: int = 8) -> "FakeOpenAI":
        """A stream that sends ``after_chunks`` chunks of ``text`` and then falls silent."""
        return self.push(Scripted(text=text, chunk_chars=chunk_chars, stall_after=after_chunks, stall_s=stall_s))

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self._script)

    # ------------------------------------------------------------- serving

    def _next(self) -> Optional[Scripted]:
        with self._lock:
            self._counter += 1
            return self._script.popleft() if self._script else None

    def _completion_body(self, item: Scripted, request_body: Any) -> dict:
        model = item.model or (request_body.get("model") if isinstance(request_body, dict) else None) or "fake"
        body: dict[str, Any] = {
            "id": f"chatcmpl-fake-{self._counter}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": item.text,
                                                 **({item.reasoning_field: item.reasoning} if item.reasoning else {})},
                         "finish_reason": item.finish_reason, "logprobs": None}],
        }
        if item.usage is not None:
            p, c = item.usage
            body["usage"] = self._usage(item)
        return body

    @staticmethod
    def _usage(item: Scripted) -> dict:
        p, c = item.usage
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if item.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": item.reasoning_tokens}
        return usage

    def _chunks(self, item: Scripted, request_body: Any) -> list[dict]:
        """The SSE chunks of a streamed completion: role, reasoning, content, finish, usage."""
        model = item.model or (request_body.get("model") if isinstance(request_body, dict) else None) or "fake"
        base = {"id": f"chatcmpl-fake-{self._counter}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}

        def chunk(delta: dict, finish: Optional[str] = None) -> dict:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        out = [chunk({"role": "assistant", "content": ""})]
        n = max(1, item.chunk_chars)
        for i in range(0, len(item.reasoning), n):
            out.append(chunk({item.reasoning_field: item.reasoning[i:i + n]}))
        for i in range(0, len(item.text), n):
            out.append(chunk({"content": item.text[i:i + n]}))
        out.append(chunk({}, item.finish_reason))
        if item.usage is not None:
            out.append({**base, "choices": [], "usage": self._usage(item)})
        return out

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10                 # an idle keep-alive connection ends its thread

            def log_message(self, *args) -> None:   # quiet
                pass

            def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
                try:
                    self.send_response(status)
                    if not any(k.lower() == "content-type" for k in headers):
                        self.send_header("Content-Type", "application/json")
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass                 # the client gave up (timeout); nothing to do

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                record = RecordedRequest(path=self.path, headers={k.lower(): v for k, v in self.headers.items()},
                                         body=body, at=time.monotonic())
                path = self.path.split("?", 1)[0].rstrip("/")
                with server._lock:
                    (server.probes if path == "/tokenize" else server.requests).append(record)
                if path == "/tokenize":
                    record.status = 200 if server.tokenize else 404
                    self._tokenize(body)
                    return
                if path not in ("/v1/chat/completions", "/chat/completions"):
                    record.status = 404
                    self._send(404, json.dumps(_error(f"fake server: no route {self.path}",
                                                      "invalid_request_error")).encode(), {})
                    return
                item = server._next()
                if item is None:
                    record.status = 418
                    self._send(418, json.dumps(_error("fake server: no scripted response left",
                                                      "script_exhausted")).encode(), {})
                    return
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if item.delay_s and server._stop.wait(item.delay_s):
                        return           # stopping
                    while item.gate is not None and not item.gate.is_set():
                        if server._stop.wait(0.02):
                            return       # stopping
                finally:
                    with server._lock:
                        server.in_flight -= 1
                record.status = item.status
                if item.body is None and isinstance(body, dict) and body.get("stream") and server.streams:
                    self._stream(item, body)
                    return
                if item.body is None:
                    payload = json.dumps(server._completion_body(item, body)).encode()
                elif isinstance(item.body, bytes):
                    payload = item.body
                else:
                    payload = json.dumps(item.body).encode()
                self._send(item.status, payload, item.headers)

            def _stream(self, item: Scripted, body: Any) -> None:
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    for i, ch in enumerate(server._chunks(item, body)):
                        if item.stall_after is not None and i == item.stall_after:
                            server._stop.wait(item.stall_s)
                            return               # falls silent, then hangs up without [DONE]
                        if i and item.chunk_delay_s and server._stop.wait(item.chunk_delay_s):
                            return
                        self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass                 # the client hung up

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0].rstrip("/")
                record = RecordedRequest(path=self.path, headers={}, body=None, at=time.monotonic(), status=200)
                with server._lock:
                    server.probes.append(record)
                if path == "/props" and server.props is not None:
                    self._send(200, json.dumps(server.props).encode(), {})
                    return
                if path in ("/v1/models", "/models") and server.models is not None:
                    self._send(200, json.dumps({"object": "list", "data": server.models}).encode(), {})
                    return
                record.status = 404
                self._send(404, json.dumps(_error(f"fake server: no route {self.path}",
                                                  "invalid_request_error")).encode(), {})

            def _tokenize(self, body: Any) -> None:
                how = server.tokenize
                if how == "llama.cpp" and isinstance(body, dict) and "content" in body:
                    n = -(-len(str(body["content"])) // server.chars_per_token)
                    self._send(200, json.dumps({"tokens": list(range(n))}).encode(), {})
                elif how == "vllm" and isinstance(body, dict) and "messages" in body:
                    text = "".join(str(m.get("content") or "") for m in body["messages"])
                    n = -(-len(text) // server.chars_per_token) + 4 * len(body["messages"])
                    self._send(200, json.dumps({"count": n, "max_model_len": 0, "tokens": list(range(n))}).encode(), {})
                else:
                    self._send(404 if how is None else 400,
                               json.dumps(_error("fake server: no tokenizer", "invalid_request_error")).encode(), {})

        return Handler


@pytest.fixture
def fake_openai(monkeypatch, tmp_path):
    """A running ``FakeOpenAI`` with OPENAI_BASE_URL / OPENAI_API_KEY pointing at it."""
    from agent.backends import context

    # Windows and slot limits are kept per base URL for the process; a port used again is another server.
    monkeypatch.setattr(context, "KNOWN", {})
    monkeypatch.setattr(context, "_LIMITERS", {})
    with FakeOpenAI() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-fake-test-key")
        monkeypatch.setenv("KERNELLOOP_CONFIG", str(tmp_path / "no-such-config.toml"))
        for var in ("OPENAI_ADMIN_KEY", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID", "OPENAI_CUSTOM_HEADERS"):
            monkeypatch.delenv(var, raising=False)
        for var in ("NO_PROXY", "no_proxy"):
            monkeypatch.setenv(var, "127.0.0.1,localhost")
        yield server
