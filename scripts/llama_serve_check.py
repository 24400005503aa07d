"""Does a llama-server build serve on this CPU? (scripts/llama_server.sh, issue 34)

Starts BINARY with MODEL on a free loopback port with the given extra arguments, asks one short
completion, stops it. Exit 0 with one line on stdout when a completion came back; exit 1 with the
reason (the server's exit status or signal and the end of its log) on stderr otherwise.

``--version`` proves nothing here: a native build can start, load the model and then die on an
illegal instruction on its first graph (seen with weight repacking on a CPU whose flags advertise
AMX), which only a real completion shows.

    python3 scripts/llama_serve_check.py BINARY MODEL [-- EXTRA_ARGS...]
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HEALTH_S = 120.0
COMPLETION_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def check(binary: str, model: str, extra: list[str]) -> tuple[bool, str]:
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                                 "-np", "1", "-t", "2", *extra],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def tail() -> str:
            log.flush()
            log.seek(0)
            return "".join(log.readlines()[-15:])

        def died() -> tuple[bool, str]:
            return False, f"llama-server {' '.join(extra) or '(no extra arguments)'}: {exit_words(proc.returncode)}\n{tail()}"

        try:
            deadline = time.monotonic() + HEALTH_S
            while True:
                if proc.poll() is not None:
                    return died()
                try:
                    if _get(f"http://127.0.0.1:{port}/health", 2) == 200:
                        break
                except (OSError, urllib.error.URLError):
                    pass
                if time.monotonic() > deadline:
                    return False, f"llama-server not healthy after {HEALTH_S:.0f} s\n{tail()}"
                time.sleep(0.3)
            body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=COMPLETION_S) as r:
                    answer = json.load(r)
            except (OSError, urllib.error.URLError, ValueError) as e:
                time.sleep(0.5)                 # let a crashing server finish dying, to name the signal
                if proc.poll() is not None:
                    return died()
                return False, f"no completion: {e}\n{tail()}"
            text = (answer.get("choices") or [{}])[0].get("text")
            tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
            if not isinstance(text, str) or tokens < 1:
                return False, f"an empty completion: {json.dumps(answer)[:300]}"
            return True, f"served a completion of {tokens} tokens: {text!r}"
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary, model, rest = argv[0], argv[1], argv[2:]
    extra = rest[1:] if rest[:1] == ["--"] else rest
    ok, words = check(binary, model, extra)
    print(words, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
