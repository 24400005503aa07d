"""Issue 37: ``kernelloop mcp``, the judge as an MCP server, driven by the SDK's own stdio client.

One session (a real ``kernelloop mcp`` process, the SDK's ``stdio_client`` and ``ClientSession``)
lists the tools, is refused bad input by name, cancels a call mid-evaluation (stopped on the
server, no verdict stored), evaluates an honest candidate and a cheating one on a seed task on
``cpu`` (with progress notifications), and reads its history; then the store holds a run of kind
``agent`` that ``runs``, ``report``, ``export``, ``replay`` and ``compare`` read, and ``eval --json``
gives the same verdict and flags for the cheat. A second client goes away mid-evaluation: the server stops the
evaluation itself, stores no verdict, and leaves no process behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "mcp"
TASK = "seeds/conv2d_divide_leakyrelu"
# honest: the convolution in PyTorch, division and LeakyReLU fused in one C++ pass (the critic's fixture)
HONEST = ROOT / "tests" / "fixtures" / "critic" / "cpu" / "fused_tail.py"
SMALL = ROOT / "tests" / "adversarial" / "task_small.py"        # the task the cancelled call evaluates
OPTIONS = ["--no-compile", "--trials", "2", "--timed-runs", "3"]


def calls_reference(task_source: str) -> str:
    """A cheat: the task's own reference Model carried along and called (no kernel of its own)."""
    return task_source + (FIX / "calls_reference_tail.py").read_text()


def _tagged(tag: str) -> list[tuple[int, str]]:
    """Processes whose environment carries ``KLTEST_MCP_TAG=tag`` (the server and every worker it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"KLTEST_MCP_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found


def _session(db: Path, tag: str, errlog: Path, script):
    """Run ``script(session)`` against a fresh ``kernelloop mcp`` through the SDK's stdio client."""
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.types import Implementation

    params = StdioServerParameters(command=sys.executable, args=["-m", "kernelloop", "mcp", *OPTIONS], cwd=str(db.parent),
                                   env={"PYTHONPATH": str(ROOT), "KERNELLOOP_DB": str(db), "KLTEST_MCP_TAG": tag})

    async def main():
        with errlog.open("w") as err:
            async with stdio_client(params, errlog=err) as (r, w):
                async with ClientSession(r, w, client_info=Implementation(name="pytest-agent", version="9.9")) as s:
                    await s.initialize()
                    return await script(s)

    return anyio.run(main)


def _json(res) -> dict:
    assert not res.is_error, res.content[0].text
    return json.loads(res.content[0].text)


def _judged(flags: list[dict]) -> list[dict]:
    """The flags that judge the candidate: `contended` says how quiet the machine was while it was timed
    (two measurements of one candidate may differ in it), so it is left out where verdicts are compared."""
    return [f for f in flags if f["kind"] != "contended"]


def _error(res) -> str:
    assert res.is_error, res.content[0].text[:500]
    return res.content[0].text


def test_an_agent_session_is_judged_stored_and_reported_as_eval_judges(tmp_path):
    import torch
    from typer.testing import CliRunner

    from kernelloop.cli import app
    from store import Store
    from store.models import Analysis, Attempt, Evaluation, Run

    db, tag = tmp_path / "kl.db", uuid.uuid4().hex
    honest = HONEST.read_text()
    cheat = calls_reference((ROOT / "tasks" / f"{TASK}.py").read_text())
    progress: list[tuple[float, str]] = []

    async def script(s):
        out: dict = {"tools": sorted(t.name for t in (await s.list_tools()).tools)}
        listed = _json(await s.call_tool("list_tasks", {"suite": "seeds"}))
        out["listed"] = {t["name"]: t for t in listed["tasks"]}
        out["shown"] = _json(await s.call_tool("show_task", {"task": TASK, "device": "cpu"}))
        bad = {
            "unknown task": {"task": "seeds/no_such_task", "source": honest, "device": "cpu"},
            "empty source": {"task": TASK, "source": "  \n", "device": "cpu"},
            "not python": {"task": TASK, "source": "class ModelNew(nn.Module:\n  pass\n", "device": "cpu"},
            "no ModelNew": {"task": TASK, "source": "import torch\nx = 1\n", "device": "cpu"},
            "directory, not a task": {"task": "seeds", "source": honest, "device": "cpu"},
            "unknown device": {"task": TASK, "source": honest, "device": "tpu"},
            "unknown precision": {"task": TASK, "source": honest, "device": "cpu", "precision": "fp7"},
        }
        if not torch.cuda.is_available():
            bad["absent gpu"] = {"task": TASK, "source": honest, "device": "cuda"}
        out["errors"] = {k: _error(await s.call_tool("evaluate", v)) for k, v in bad.items()}
        out["history_before"] = _json(await s.call_tool("history", {"task": TASK}))

        # a call the client cancels mid-evaluation: stopped on the server, no verdict stored; the
        # session goes on with fresh workers
        import anyio

        with anyio.CancelScope() as scope:
            async def cancel_at_trials(p, total, message):
                if (message or "").startswith("checks: trials"):
                    scope.cancel()

            await s.call_tool("evaluate", {"task": str(SMALL), "source": (FIX / "hangs.py").read_text(),
                                           "device": "cpu"}, progress_callback=cancel_at_trials)
        out["cancelled"] = scope.cancelled_caught
        out["history_cancelled"] = _json(await s.call_tool("history", {"task": str(SMALL)}))

        async def on_progress(p, total, message):
            progress.append((p, message or ""))

        out["honest"] = _json(await s.call_tool("evaluate", {"task": TASK, "source": honest, "device": "cpu"},
                                                progress_callback=on_progress))
        out["cheat"] = _json(await s.call_tool("evaluate", {"task": TASK, "source": cheat, "device": "cpu"}))
        out["history"] = _json(await s.call_tool("history", {"task": TASK}))
        out["baseline"] = _json(await s.call_tool("baseline", {"task": TASK, "device": "cpu"}))
        return out

    out = _session(db, tag, tmp_path / "server.err", script)
    assert out["tools"] == ["baseline", "evaluate", "history", "list_tasks", "show_task"]
    assert TASK in out["listed"] and out["listed"][TASK]["cpu_sizes"]["batch_size"] == 2
    shown = out["shown"]
    assert "class Model" in shown["source"] and shown["sizes"]["in_channels"] == 8 and shown["sizes"]["kernel_size"] == 3
    assert shown["numerics"]["default"] == "fp32/default" and shown["baselines"] == []

    # bad input: a tool error naming its cause, and nothing stored
    errors = out["errors"]
    assert "no task file or directory 'seeds/no_such_task'" in errors["unknown task"]
    assert "source is empty" in errors["empty source"]
    assert "source is not Python" in errors["not python"] and "line 1" in errors["not python"]
    assert "no class ModelNew" in errors["no ModelNew"]
    assert "names 5 task files; name one" in errors["directory, not a task"]
    assert "must be cuda or cpu, not 'tpu'" in errors["unknown device"]
    assert "fp7" in errors["unknown precision"]
    if "absent gpu" in errors:
        assert "no CUDA GPU is visible" in errors["absent gpu"]
    assert out["history_before"]["attempts"] == []

    assert out["cancelled"] and "evaluation of attempt 1 stopped" in (tmp_path / "server.err").read_text()
    h, c = out["honest"], out["cheat"]
    assert h["status"] == "correct" and _judged(h["flags"]) == [], h
    assert h["clean"] is (h["flags"] == []), h
    assert h["speedup_eager"] > 0 and "speedup_compile" in h and h["speedup_compile"] is None     # --no-compile
    assert h["numerics"] == "fp32/default" and "medians of 3 timed runs" in h["convention"]
    assert h["floor_fraction"] is None or 0 < h["floor_fraction"] <= 1.5
    assert h["analysis"].startswith("# Analysis of") and h["critic"] == "grounded"
    assert c["status"] == "correct" and not c["clean"]
    assert {"fallback", "no_custom_kernel"} <= {f["kind"] for f in c["flags"]}, c["flags"]
    assert "fallback" in c["analysis"]
    # progress: build, checks and timing, in that order, then done
    messages = [m for _, m in progress]
    firsts = [next(i for i, m in enumerate(messages) if m.startswith(w)) for w in ("build", "checks", "timing", "done")]
    assert firsts == sorted(firsts), messages
    assert [p for p, _ in progress] == sorted(p for p, _ in progress)
    # history: this session's attempts, best (clean) first
    hist = out["history"]["attempts"]
    assert sorted(a["attempt_id"] for a in hist) == [h["attempt_id"], c["attempt_id"]]
    if h["clean"]:      # a contended honest attempt is not clean, and then the faster of the two leads
        assert [a["attempt_id"] for a in hist] == [h["attempt_id"], c["attempt_id"]] and hist[0]["clean"]
    assert [a["status"] for a in out["history_cancelled"]["attempts"]] == ["not evaluated (interrupted)"]
    # the reference times this session measured, by attempt (in the history's order, so the honest
    # attempt leads only when it is clean)
    seen = {b["attempt_id"]: b["eager_ms"] for b in out["baseline"]["in_this_session"]}
    assert seen[h["attempt_id"]] == h["eager_ms"], out["baseline"]

    # the store: one run of kind agent, model mcp:<client>, two attempts with evaluations and analyses
    store = Store(str(db))
    try:
        with store.reader() as s:
            runs = s.query(Run).all()
            # interrupted: one of its attempts has no verdict (as an interrupted optimize run's)
            assert [(r.kind, r.model, r.status, r.device) for r in runs] == [("agent", "mcp:pytest-agent", "interrupted",
                                                                              "cpu")]
            run = runs[0]
            assert run.config["client"] == {"name": "pytest-agent", "version": "9.9"}
            attempts = s.query(Attempt).order_by(Attempt.id).all()
            assert [(a.round, a.parent_ids) for a in attempts] == [(0, []), (0, []), (1, [attempts[1].id])]
            assert [t["name"] for t in run.config["tasks"]] == ["adversarial/task_small", TASK]
            assert [e.attempt_id for e in s.query(Evaluation).order_by(Evaluation.id)] == [h["attempt_id"], c["attempt_id"]]
            assert [e.status for e in s.query(Evaluation).order_by(Evaluation.id)] == ["correct", "correct"]
            assert s.query(Analysis).filter(Analysis.run_id == run.id).count() == 2
    finally:
        store.close()

    runner = CliRunner()
    report = runner.invoke(app, ["report", str(run.id), "--db", str(db)])
    assert report.exit_code == 0, report.output
    assert TASK in report.output and "mcp:pytest-agent" in report.output
    listed = runner.invoke(app, ["runs", "--db", str(db)])
    assert listed.exit_code == 0 and "agent" in listed.output and "mcp:pytest-agent" in listed.output
    exported = runner.invoke(app, ["export", str(run.id), "--jsonl", str(tmp_path / "run.jsonl"), "--db", str(db)])
    assert exported.exit_code == 0, exported.output
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    attempts_out = [r for r in records if r["type"] == "attempt"]
    by_task = {}
    for r in attempts_out:
        by_task.setdefault(r["task"]["name"], []).append(r)
    assert [r["candidate_source"] for r in by_task[TASK]] == [honest, cheat]
    # clean: the cheat is flagged; the honest one as the tool said (a `contended` window, which the
    # tool's verdict may carry on a loaded host, makes it not clean in the export either)
    assert [r["correct"] for r in by_task[TASK]] == [h["clean"], False]
    assert [r["evaluation"] for r in by_task["adversarial/task_small"]] == [None]
    # replay reuses the stored evaluations (same device, torch and configuration); compare reads both runs
    replayed = runner.invoke(app, ["replay", str(run.id), "--device", "cpu", "--tasks", TASK, "--db", str(db)])
    assert replayed.exit_code == 0, replayed.output
    compared = runner.invoke(app, ["compare", str(run.id), str(run.id + 1), "--json", "--db", str(db)])
    assert compared.exit_code == 0, compared.output
    assert TASK in compared.output

    # `eval --json` judges the same candidate alike: the same verdict and the same flags, reasons included
    cand = tmp_path / "cheat.py"
    cand.write_text(cheat)
    ev = runner.invoke(app, ["eval", TASK, str(cand), "--device", "cpu", *OPTIONS, "--json"])
    assert ev.exit_code == 0, ev.output
    data = json.loads(ev.output[ev.output.index("{"):])
    assert data["status"] == c["status"] and _judged(data["flags"]) == _judged(c["flags"])
    assert data["config"]["numerics"]["precision"] == "fp32" and c["numerics"] == "fp32/default"
    assert _tagged(tag) == []


def test_a_client_that_goes_away_mid_evaluation_leaves_no_process_and_no_verdict(tmp_path):
    from store import Store
    from store.models import Attempt, Evaluation, Run

    db, tag = tmp_path / "kl.db", uuid.uuid4().hex
    err = tmp_path / "server.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERNELLOOP_DB": str(db), "KLTEST_MCP_TAG": tag,
           "KLTEST_SERVER_ERR": str(err)}
    client = subprocess.run([sys.executable, str(FIX / "drop_client.py"), TASK, str(FIX / "hangs.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert client.returncode == 0, client.stdout + client.stderr
    assert "checks: trials" in client.stdout
    deadline = time.monotonic() + 60
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _tagged(tag) == [], "left running: " + "; ".join(c for _, c in _tagged(tag))
    # the server stopped the evaluation itself (the client never cancelled it, nor killed anything)
    log = err.read_text()
    assert "evaluation of attempt 1 stopped" in log, log[-3000:]
    store = Store(str(db))
    try:
        with store.reader() as s:
            assert [(r.kind, r.status) for r in s.query(Run)] == [("agent", "interrupted")]
            assert s.query(Attempt).count() == 1 and s.query(Evaluation).count() == 0
    finally:
        store.close()
