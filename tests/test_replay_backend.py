"""The replay backend and ``kernelloop logs``, both over a temporary store.

(The logs CLI's tests live here too: both read model calls from the same kind of store.)
"""
from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from agent.backends.base import BackendError, get_backend
from agent.logs_cli import app
from agent.types import DeviceFacts, ProposalRequest
from sandbox.tasks import TaskSpec
from store.models import Attempt, ModelCall, Run, Task

TASK_A = TaskSpec(name="seeds/add_relu", path="/tasks/seeds/add_relu.py", source="class Model: pass  # A\n")
TASK_B = TaskSpec(name="seeds/gemm_lse", path="/tasks/seeds/gemm_lse.py", source="class Model: pass  # B\n")
DEVICE = DeviceFacts(device="cpu", name="test cpu", torch_version="2.13.0")
MESSAGES = [{"role": "system", "content": "sys [bold]not markup[/bold]"}, {"role": "user", "content": "write it"}]


def _run(session, model: str = "openai:gpt-4o") -> Run:
    run = Run(kind="optimize", status="finished", model=model, critic="llm", device="cpu", device_name="test cpu",
              torch_version="2.13.0", code_version="test", config={})
    session.add(run)
    session.flush()
    return run


def _task(session, spec: TaskSpec) -> Task:
    task = Task(name=spec.name, path=spec.path, sha256=spec.sha256, source=spec.source)
    session.add(task)
    session.flush()
    return task


def _call(session, run: Run, task: Task, rnd: int, text: str | None, purpose: str = "propose",
          error: str | None = None, **extra) -> ModelCall:
    fields = dict(run_id=run.id, task_id=task.id, round=rnd, purpose=purpose, model=run.model,
                  template="propose_first" if rnd == 0 else "propose_refine", prompt_sha256="ab" * 32,
                  messages=MESSAGES, response_text=text, finish_reason=None if error else "stop",
                  prompt_tokens=None if error else 1000 + rnd, completion_tokens=None if error else 200 + rnd,
                  latency_s=12.5, cost_usd=None if error else 0.0045, error=error)
    fields.update(extra)
    call = ModelCall(**fields)
    session.add(call)
    session.flush()
    return call


def _attempt(session, run: Run, task: Task, rnd: int, sample: int, call: ModelCall | None) -> Attempt:
    attempt = Attempt(run_id=run.id, task_id=task.id, round=rnd, sample=sample,
                      model_call_id=call.id if call else None, parse_status="ok", source="x", sha256="0" * 64,
                      parent_ids=[])
    session.add(attempt)
    session.flush()
    return attempt


@pytest.fixture
def store(tmp_store):
    """Run 1 (openai:gpt-4o) proposed for two tasks over two rounds; run 2 (another model) once."""
    s = tmp_store
    with s.session() as session:
        run = _run(session)
        a, b = _task(session, TASK_A), _task(session, TASK_B)
        for rnd in (0, 1):
            for sample in (0, 1):
                call = _call(session, run, a, rnd, f"answer A r{rnd} s{sample}")
                _attempt(session, run, a, rnd, sample, call)
        call = _call(session, run, b, 0, "answer B r0 s0")
        _attempt(session, run, b, 0, 0, call)
        failed = _call(session, run, b, 0, None, error="openai:gpt-4o answered 500 (gave up after 6 tries)")
        _attempt(session, run, b, 0, 1, failed)
        _call(session, run, a, 1, "the critic's analysis", purpose="critique", template="critique")
        _attempt(session, run, b, 1, 0, None)                   # an attempt without a model call
        other = _run(session, model="openai:o3-mini")
        _attempt(session, other, a, 0, 0, _call(session, other, a, 0, "o3 answer", cost_usd=0.1))
    return s


def request(spec: TaskSpec, rnd: int) -> ProposalRequest:
    return ProposalRequest(task=spec, device=DEVICE, round=rnd, samples=2, messages=[], template="propose_refine",
                           prompt_sha256="0" * 64)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the replay backend opened a network connection")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ------------------------------------------------------------------ replay

def test_replay_serves_the_stored_answer_of_each_task_round_and_sample(store, no_network):
    b = get_backend("replay:1", store=store)
    assert b.name == "replay:1" and b.default_critic == "grounded" and b.max_concurrency >= 1
    for rnd in (0, 1):
        for sample in (0, 1):
            c = b.complete(request(TASK_A, rnd), sample)
            assert c.error is None
            assert c.text == f"answer A r{rnd} s{sample}"
            assert c.finish_reason == "stop"
            assert (c.prompt_tokens, c.completion_tokens) == (1000 + rnd, 200 + rnd)
            assert c.cost_usd == 0.0 and c.latency_s < 1
    assert b.complete(request(TASK_B, 0), 0).text == "answer B r0 s0"


def test_replay_matches_tasks_by_source_hash_not_name(store, no_network):
    renamed = TaskSpec(name="elsewhere/renamed", path="/other/place.py", source=TASK_A.source)
    assert get_backend("replay:1", store=store).complete(request(renamed, 0), 1).text == "answer A r0 s1"


def test_replay_missing_completion_is_an_error_completion(store, no_network):
    b = get_backend("replay:1", store=store)
    for spec, rnd, sample in [(TASK_A, 2, 0), (TASK_A, 0, 5), (TASK_B, 1, 0)]:
        c = b.complete(request(spec, rnd), sample)
        assert c.text == ""
        assert c.error.startswith("no stored completion for run 1")
        assert f"round {rnd}, sample {sample}" in c.error
    changed = TaskSpec(name=TASK_A.name, path=TASK_A.path, source=TASK_A.source + "# edited\n")
    assert "no stored completion" in b.complete(request(changed, 0), 0).error


def test_replay_serves_a_stored_failure_as_a_failure(store, no_network):
    c = get_backend("replay:1", store=store).complete(request(TASK_B, 0), 1)
    assert c.text == ""
    assert "had failed" in c.error and "gave up after 6 tries" in c.error


def test_replay_only_serves_proposals(store, no_network):
    b = get_backend("replay:1", store=store)
    assert b.chat([{"role": "user", "content": "critique"}]).error


def test_replay_configuration_errors(store):
    with pytest.raises(BackendError, match="run id"):
        get_backend("replay:abc", store=store)
    with pytest.raises(BackendError, match="no run 99"):
        get_backend("replay:99", store=store)
    with pytest.raises(BackendError, match="needs the store"):
        get_backend("replay:1")
    b = get_backend("replay:2", db=store.url, temperature=0.5)   # a store by URL; other backends' options
    assert b.complete(request(TASK_A, 0), 0).text == "o3 answer"


# ------------------------------------------------------------------ logs CLI

def invoke(store, *args: str):
    result = CliRunner().invoke(app, [*args, "--db", store.url])
    assert result.exit_code == 0, result.output
    return result.output


def test_logs_lists_recent_calls_newest_first(store):
    rows = json.loads(invoke(store, "--json"))
    assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), reverse=True)
    assert len(rows) == 8
    first = rows[-1]
    assert first["task"] == "seeds/add_relu" and first["purpose"] == "propose" and first["template"] == "propose_first"
    assert (first["prompt_tokens"], first["completion_tokens"], first["latency_s"], first["cost_usd"]) == \
        (1000, 200, 12.5, 0.0045)
    assert json.loads(invoke(store, "list", "--json")) == rows


def test_logs_filters(store):
    def ids(*args):
        return [r["id"] for r in json.loads(invoke(store, "list", "--json", *args))]

    assert len(ids("--run", "1")) == 7
    assert len(ids("--run", "2")) == 1
    assert len(ids("--task", "gemm")) == 2
    assert len(ids("--task", "2")) == 2                         # a task id
    assert len(ids("--purpose", "critique")) == 1
    assert len(ids("--model", "o3")) == 1
    errors = json.loads(invoke(store, "--json", "--errors"))
    assert len(errors) == 1 and "gave up" in errors[0]["error"]
    assert len(ids("-n", "3")) == 3
    assert ids("--run", "1", "--purpose", "propose", "--task", "add_relu", "-n", "2") == \
        ids("--run", "1", "--task", "add_relu", "--purpose", "propose")[:2]


def test_logs_table(store):
    out = invoke(store)
    lines = out.splitlines()
    assert lines[0].split() == ["id", "run", "task", "rnd", "purpose", "model", "template", "in", "out",
                                "latency", "cost", "error"]
    assert len(lines) == 1 + 8                                  # one line per call: nothing wraps in a pipe
    row = lines[-1].split()                                     # the oldest call
    assert row == ["1", "1", "seeds/add_relu", "0", "propose", "openai:gpt-4o", "propose_first", "1000", "200",
                   "12.5s", "$0.0045"]
    assert "openai:gpt-4o answered 500 (gave up after 6 tries)" in out
    assert "gave up" in invoke(store, "--errors")
    assert "no model calls match" in invoke(store, "--run", "42")


def test_logs_show(store):
    rows = json.loads(invoke(store, "--json", "--task", "gemm", "--errors"))
    failed_id = rows[0]["id"]
    out = invoke(store, "show", "1")
    assert "model call 1" in out and "propose_first" in out
    assert "sys [bold]not markup[/bold]" in out                 # content printed verbatim
    assert "===== message 1: user =====\nwrite it" in out
    assert "answer A r0 s0" in out
    data = json.loads(invoke(store, "show", "1", "--json"))
    assert data["messages"] == MESSAGES and data["response_text"] == "answer A r0 s0"
    assert "error: openai:gpt-4o answered 500" in invoke(store, "show", str(failed_id))


def test_logs_show_unknown_id(store):
    result = CliRunner().invoke(app, ["show", "999", "--db", store.url])
    assert result.exit_code == 2
    assert "no model call 999" in result.output
