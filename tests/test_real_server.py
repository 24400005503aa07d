"""kernelloop against a real model server users run: llama.cpp's llama-server, serving
SmolLM2-135M-Instruct on loopback (issue 25). Not one of our endpoints: the server's window, slots,
queueing and speed are its own, and its log is its own account of every generation.

(a) a 4096-token window per slot, max_tokens 1024, two seed tasks, three rounds of two samples:
    the run finishes with every attempt made, no call fails on the window, and the server stopped
    no answer for a full window;
(b) a slow server (one thread, four slots) with every client setting at its default: the run
    finishes, no call times out and the server abandons no generation. CI runs a shorter (b)
    (one task); ``KERNELLOOP_FULL_B=1`` (``scripts/real_server_b.sh``) runs two tasks.

The server comes from ``scripts/llama_server.sh`` (scripts/test.sh runs it, and sets
KERNELLOOP_REQUIRE_REAL_SERVER=1 so that a missing server fails instead of skipping).
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llama_server import MODEL_ALIAS, LlamaServer, model_file, server_binary

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["seeds/gemm_sigmoid_gemm_logsumexp", "seeds/conv2d_divide_leakyrelu"]

pytestmark = [pytest.mark.real_server, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_server():
    if server_binary() is None or model_file() is None:
        why = "needs llama-server and the SmolLM2 GGUF: run scripts/llama_server.sh"
        if os.environ.get("KERNELLOOP_REQUIRE_REAL_SERVER") == "1":
            pytest.fail(why)
        pytest.skip(why)


def optimize(server: LlamaServer, db: Path, tasks: list[str], rounds: int, samples: int, *extra: str,
             timeout_s: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-local",
           "KERNELLOOP_DB": str(db)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kernelloop", "optimize", *tasks, "--model", f"openai:{MODEL_ALIAS}",
                           "--rounds", str(rounds), "--samples", str(samples), "--device", "cpu", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - started


def figures(db: Path) -> dict:
    with sqlite3.connect(db) as conn:
        run = conn.execute("SELECT id, status FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        calls = conn.execute("SELECT purpose, error, finish_cause, prompt_tokens, completion_tokens, latency_s "
                             "FROM model_calls WHERE run_id = ?", (run[0],)).fetchall()
        attempts = conn.execute("SELECT round, sample, parse_status FROM attempts WHERE run_id = ?",
                                (run[0],)).fetchall()
    return {"status": run[1], "calls": calls, "attempts": attempts,
            "errors": [c[1] for c in calls if c[1]],
            "prompt_tokens": sum(c[3] or 0 for c in calls), "completion_tokens": sum(c[4] or 0 for c in calls)}


def report(name: str, wall_s: float, f: dict, server: LlamaServer) -> str:
    line = (f"{name}: wall {wall_s:.0f} s, status {f['status']}, {len(f['attempts'])} attempts, "
            f"{len(f['calls'])} calls, {f['prompt_tokens']} prompt + {f['completion_tokens']} completion tokens, "
            f"{len(f['errors'])} errors, server finished {len(server.finished())} generations "
            f"({sum(t for _, t in server.finished())} stopped by a full window), "
            f"{len(server.cancelled())} cancelled")
    print(line)
    out = os.environ.get("KERNELLOOP_REAL_SERVER_REPORT")
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")
    return line


def test_a_prompts_fit_a_4096_token_window(tmp_path: Path):
    server = LlamaServer(tmp_path / "server.log", ctx=8192, parallel=2, threads=2)    # 4096 tokens per slot
    try:
        assert server.props()["default_generation_settings"]["n_ctx"] == 4096
        proc, wall = optimize(server, tmp_path / "a.db", TASKS, 3, 2, "--max-tokens", "1024")
        f = figures(tmp_path / "a.db")
        line = report("(a)", wall, f, server)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f["status"] == "finished", line
        # every attempt made: two tasks x three rounds x two samples
        assert sorted((r, s) for r, s, _ in f["attempts"]) == sorted(
            [(r, s) for r in range(3) for s in range(2)] * 2), line
        assert not [e for e in f["errors"] if "context" in e.lower() or "window" in e.lower()], f["errors"]
        assert not [c for c in f["calls"] if c[2] == "window"], line
        finished = server.finished()
        assert len(finished) >= len(f["calls"]), line       # the server's own account of every answer
        assert not [n for n, truncated in finished if truncated], line
    finally:
        server.stop()


def test_b_a_slow_server_with_default_client_settings(tmp_path: Path):
    tasks = TASKS if os.environ.get("KERNELLOOP_FULL_B") == "1" else TASKS[:1]
    server = LlamaServer(tmp_path / "server.log", ctx=16384, parallel=4, threads=1)   # 4096 per slot, one thread
    try:
        assert server.props()["total_slots"] == 4
        proc, wall = optimize(server, tmp_path / "b.db", tasks, 1, 2, timeout_s=3600)
        f = figures(tmp_path / "b.db")
        line = report("(b)" if len(tasks) == 2 else "(b, one task)", wall, f, server)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f["status"] == "finished", line
        assert len(f["attempts"]) == 2 * len(tasks), line
        assert not f["errors"], f["errors"]                   # no call timed out or failed
        assert not server.cancelled(), line                   # no generation abandoned
        assert len(server.finished()) == len(f["calls"]), line   # each call generated once, no retries
    finally:
        server.stop()
