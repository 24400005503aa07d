"""The optimisation loop end to end on the CPU: ``kernelloop optimize`` (through typer's
CliRunner, in this process) with the real ``openai`` client against the loopback Chat
Completions server (``tests/fakeserver.py``), real C++ builds and the real store.

Scripted answers (tests/fixtures/loop/): a correct candidate, an incorrect one (the scale
doubled), one that does not compile (a missing semicolon) and prose with no code. The
correct and incorrect candidates share their C++ source, so the content-hashed build
cache builds it once; with the compile error that is two C++ builds for this file.

Also: a source answered twice is evaluated once; ``runs``/``show`` print the run;
``--model replay:RUN`` reruns the loop from stored completions with no request to the
server; bad input (a task with a syntax error, an unknown model, no API key, a rejected
key mid-run) fails with a message that names the cause, storing nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "loop"))

from fakeserver import FakeOpenAI, RecordedRequest  # noqa: E402
from support import (BAD_SYNTAX_TASK, MODEL, TASK, TASK_NAME, answer, count, internal_compiler_errors,  # noqa: E402
                     no_compiler_crash, optimize_args, prose, query, shared_cache_dir, source, tag_of)

pytestmark = pytest.mark.timeout(420)

# What each scripted answer of the main run must become: (round, parse status, verdict).
EXPECTED = {"A": (0, "ok", "correct"), "B": (0, "ok", "compile_error"),
            "C": (1, "ok", "incorrect"), "D": (1, "no_code", None)}


# ------------------------------------------------------------------ fixtures and helpers

@pytest.fixture(scope="module")
def loop_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pytest.MonkeyPatch]:
    """The environment of every command in this file: a build cache shared with
    test_resume.py, no developer config, no proxy for the loopback server, no KERNELLOOP_DB."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KERNELLOOP_CACHE", str(shared_cache_dir(tmp_path_factory)))
    mp.setenv("KERNELLOOP_CONFIG", str(tmp_path_factory.mktemp("loop-config") / "no-such-config.toml"))
    mp.delenv("KERNELLOOP_DB", raising=False)
    for var in ("OPENAI_ADMIN_KEY", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID", "OPENAI_CUSTOM_HEADERS"):
        mp.delenv(var, raising=False)
    for var in ("NO_PROXY", "no_proxy"):
        mp.setenv(var, "127.0.0.1,localhost")
    yield mp
    mp.undo()


@contextmanager
def serving(mp: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """A fake server that OPENAI_BASE_URL / OPENAI_API_KEY point at while the block runs."""
    with FakeOpenAI() as server, pytest.MonkeyPatch.context() as local:
        local.setenv("OPENAI_BASE_URL", server.url)
        local.setenv("OPENAI_API_KEY", "sk-fake-loop-test")
        yield server


def invoke(args: list[str]) -> Any:
    from kernelloop.cli import app

    return CliRunner().invoke(app, args)


def flat(text: str) -> str:
    """CLI output with rich's line wrapping undone (for matching long paths and messages)."""
    return re.sub(r"\s+", "", text)


def user_text(request: RecordedRequest) -> str:
    return next(m["content"] for m in request.body["messages"] if m["role"] == "user")


def ms(value: float) -> str:
    from agent.prompts import _ms

    return _ms(value)


@dataclass
class LoopRun:
    db: Path
    run_id: int
    requests: list[RecordedRequest]
    output: str
    seconds: float
    max_in_flight: int
    by_tag: dict[str, dict[str, Any]] = field(default_factory=dict)   # tag -> call/attempt/evaluation


def _by_tag(db: Path, run_id: int) -> dict[str, dict[str, Any]]:
    rows = query(db, """
        SELECT c.response_text, c.id, c.round, c.template, c.prompt_sha256, c.messages, c.prompt_tokens,
               c.completion_tokens, c.latency_s, c.purpose, c.model, c.error,
               a.id, a.round, a.sample, a.parse_status, a.parent_ids, a.sha256, a.model_call_id
        FROM model_calls c JOIN attempts a ON a.model_call_id = c.id
        WHERE a.run_id = ? ORDER BY a.round, a.sample""", (run_id,))
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        evs = query(db, "SELECT id, status, reused_from, candidate_ms, eager_ms, speedup_eager, result "
                        "FROM evaluations WHERE attempt_id = ? ORDER BY id", (r[12],))
        out[tag_of(r[0])] = {
            "call_id": r[1], "call_round": r[2], "template": r[3], "prompt_sha256": r[4],
            "messages": json.loads(r[5]), "prompt_tokens": r[6], "completion_tokens": r[7], "latency_s": r[8],
            "purpose": r[9], "model": r[10], "error": r[11],
            "attempt_id": r[12], "round": r[13], "sample": r[14], "parse_status": r[15],
            "parent_ids": json.loads(r[16]), "sha256": r[17],
            "evaluations": [{"id": e[0], "status": e[1], "reused_from": e[2], "candidate_ms": e[3],
                             "eager_ms": e[4], "speedup_eager": e[5], "result": json.loads(e[6])} for e in evs],
        }
    return out


def _compile_error_eval(db: Path) -> int:
    sha = hashlib.sha256(source("compile_error.py").encode()).hexdigest()
    rows = query(db, "SELECT id FROM evaluations WHERE candidate_sha256 = ?", (sha,))
    return rows[0][0] if rows else -1


@pytest.fixture(scope="module")
def first_run(loop_env: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> LoopRun:
    """``kernelloop optimize`` over the small task: 2 rounds x 2 samples, the brief's flags.

    Round 0 answers (asked concurrently, either sample may get either): A correct, B does not
    compile. Round 1: C incorrect (wrong scale; same C++ as A, a build-cache hit), D prose."""
    db = tmp_path_factory.mktemp("loop-first-run") / "store.db"
    with serving(loop_env) as server:
        # Round 0's answers take a second, so the two concurrent requests overlap at the server.
        server.reply(answer("correct.py", "A"), delay_s=1.0)
        server.reply(answer("compile_error.py", "B"), delay_s=1.0)
        server.reply(answer("wrong_scale.py", "C"))
        server.reply(prose("D"))
        t0 = time.monotonic()
        result = invoke(optimize_args(db))
        seconds = time.monotonic() - t0
        requests = list(server.requests)
        remaining, in_flight = server.remaining, server.max_in_flight
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert remaining == 0, f"{remaining} scripted answer(s) never asked for\n{result.output}"
    runs = query(db, "SELECT id FROM runs")
    assert len(runs) == 1
    # A compiler crash is expected only from the candidate that does not compile anyway.
    crashes = [c for c in internal_compiler_errors(db) if not c.startswith(f"evaluation {_compile_error_eval(db)}:")]
    if crashes:
        pytest.fail("the C++ compiler crashed while reading torch's shared precompiled header (another "
                    "process rebuilt torch/extension.h.gch meanwhile; see sandbox/build.py _ensure_pch): "
                    + "; ".join(crashes))
    run = LoopRun(db=db, run_id=runs[0][0], requests=requests, output=result.output, seconds=seconds,
                  max_in_flight=in_flight)
    run.by_tag = _by_tag(db, run.run_id)
    return run


# ------------------------------------------------------------------ 1. the whole run, in the store

def test_run_row_records_model_device_config_and_finishes(first_run: LoopRun) -> None:
    (kind, status, model, critic, device, torch_version, config, finished_at, parent) = query(
        first_run.db, "SELECT kind, status, model, critic, device, torch_version, config, finished_at, "
                      "parent_run_id FROM runs WHERE id = ?", (first_run.run_id,))[0]
    import torch

    assert (kind, status, model, critic, device) == ("optimize", "finished", MODEL, "grounded", "cpu")
    assert torch_version == torch.__version__ and finished_at is not None and parent is None
    config = json.loads(config)
    assert (config["model"], config["device"], config["rounds"], config["samples"], config["critic"]) == \
        (MODEL, "cpu", 2, 2, "grounded")
    assert (config["eval"]["trials"], config["eval"]["timed_runs"], config["eval"]["time_compile"]) == (2, 3, False)
    assert [t["name"] for t in config["tasks"]] == [TASK_NAME]
    assert config["tasks"][0]["sha256"] == hashlib.sha256(TASK.read_text().encode()).hexdigest()
    assert query(first_run.db, "SELECT name FROM tasks") == [(TASK_NAME,)]
    assert f"run {first_run.run_id}" in first_run.output and "finished" in first_run.output


def test_progress_lines_say_each_change_once(first_run: LoopRun) -> None:
    """Logs (not a terminal): a round's start, its results and the task's end, each once; never a
    tally of nothing ("0/0") and never the same line twice."""
    lines = [line for line in first_run.output.splitlines() if line.startswith(f"{TASK_NAME}: ")]
    said = [line[len(TASK_NAME) + 2:] for line in lines]
    assert said[0] == "round 0 started", lines
    assert said[1].startswith("round 0 evaluated: ") and " of 2 attempt(s) correct (" in said[1], lines
    assert said[2].startswith("round 1 started (") and said[3].startswith("round 1 evaluated: "), lines
    assert said[4:] == ["finished (2 round(s) done)"], lines
    assert len(set(lines)) == len(lines) and not any("0 of 0" in line or "0/0" in line for line in lines)


def test_a_resume_of_a_task_whose_rounds_are_all_stored_says_only_that_it_finished(
        first_run: LoopRun, loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On an H100 a resumed KernelBench run printed "round 0 started" for each of 50 tasks it
    had finished before, then "finished": it now says once that they finished, and that their
    rounds were stored before. The summary counts correct verdicts and clean ones apart."""
    import shutil

    db = tmp_path / "copy.db"
    shutil.copy(first_run.db, db)
    with serving(loop_env) as server:
        result = invoke(["optimize", "--resume", str(first_run.run_id), "--db", str(db)])
        asked = len(server.requests)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert asked == 0
    lines = [line for line in result.output.splitlines() if line.startswith(f"{TASK_NAME}: ")]
    assert len(lines) == 1 and "started" not in lines[0], lines
    # the clean count is the store's: a contended timing (a loaded CI host) leaves the correct attempt unclean
    from sandbox.result import EvalResult

    stored = [EvalResult.model_validate(json.loads(r)) for (r,) in query(db, "SELECT result FROM evaluations")]
    clean = sum(1 for r in stored if r.correct and r.clean)
    assert clean <= 1
    assert lines[0].startswith(f"{TASK_NAME}: finished (2 round(s) done, 2 of them stored before this --resume); "
                               f"1 of 4 attempt(s) correct ({clean} clean) so far"), lines
    text = flat(result.output)
    assert "correct:theverdict;clean:correctwithnodisqualifyingflag" in text


def test_a_resume_with_more_rounds_runs_only_the_new_rounds_and_stores_the_runs_new_rounds(
        first_run: LoopRun, loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A level-2 run of two rounds, resumed to four (session ad on one H200): its stored rounds
    are kept, only the new ones are asked for, and the run's config says how many it now has."""
    import shutil

    db = tmp_path / "copy.db"
    shutil.copy(first_run.db, db)
    with serving(loop_env) as server:
        server.reply(prose("E"))
        server.reply(prose("F"))
        result = invoke(["optimize", "--resume", str(first_run.run_id), "--rounds", "3", "--db", str(db)])
        asked = len(server.requests)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert asked == 2
    assert query(db, "SELECT round, count(*) FROM attempts GROUP BY round ORDER BY round") == [(0, 2), (1, 2), (2, 2)]
    (config,) = query(db, "SELECT config FROM runs WHERE id = ?", (first_run.run_id,))[0]
    assert json.loads(config)["rounds"] == 3
    assert "finished (3 round(s) done, 2 of them stored before this --resume)" in " ".join(result.output.split())


def test_a_resume_given_other_tasks_than_its_runs_fails_naming_them_and_stores_nothing(
        first_run: LoopRun, loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A GPU lane resumed its store's last run with a new lane's task list: the run's own tasks
    were finished, the new ones were silently left unrun, and it exited 0. Task arguments given
    with --resume must be the run's own; the same task file given again is accepted."""
    import shutil

    db = tmp_path / "copy.db"
    shutil.copy(first_run.db, db)
    before = query(db, "SELECT count(*) FROM attempts")
    with serving(loop_env) as server:
        other = invoke(["optimize", str(Path(__file__).parent / "fixtures" / "builtin" / "norm_split.py"), "--resume",
                        str(first_run.run_id), "--db", str(db)])
        same = invoke(["optimize", str(TASK), "--resume", str(first_run.run_id), "--db", str(db)])
        asked = len(server.requests)
    assert other.exit_code != 0
    text = flat(other.output)
    assert f"run{first_run.run_id}isover1task(s)ofitsown" in text and "norm_split.py" in text, other.output
    assert f"left out: {TASK_NAME}" in " ".join(other.output.split()), other.output
    assert same.exit_code == 0, same.output + repr(same.exception)
    assert asked == 0 and query(db, "SELECT count(*) FROM attempts") == before


def test_model_calls_one_per_sample_with_templates_hash_tokens_latency(first_run: LoopRun) -> None:
    from agent.prompts import messages_sha256

    calls = query(first_run.db, "SELECT purpose, round, template FROM model_calls WHERE run_id = ? ORDER BY id",
                  (first_run.run_id,))
    assert len(calls) == 4, calls
    assert [c[:2] for c in calls] == [("propose", 0), ("propose", 0), ("propose", 1), ("propose", 1)]
    assert sorted(first_run.by_tag) == ["A", "B", "C", "D"]
    for tag, row in first_run.by_tag.items():
        rnd = EXPECTED[tag][0]
        assert row["call_round"] == rnd and row["purpose"] == "propose" and row["error"] is None
        assert row["template"] == ("propose_first" if rnd == 0 else "propose_refine")
        assert row["model"] == MODEL
        assert (row["prompt_tokens"], row["completion_tokens"]) == (11, 22)      # the fake server's usage
        assert row["latency_s"] is not None and row["latency_s"] < 60
        if rnd == 0:
            assert row["latency_s"] >= 0.9                                       # the scripted 1 s delay
        # The hash is of the messages as stored, and those are what the server received.
        assert row["prompt_sha256"] == messages_sha256(row["messages"])
        assert any(r.body["messages"] == row["messages"] for r in first_run.requests)
    t = first_run.by_tag
    assert t["A"]["prompt_sha256"] == t["B"]["prompt_sha256"] != t["C"]["prompt_sha256"] == t["D"]["prompt_sha256"]
    # Every request asked for the configured model; the two samples of a round were in flight at once.
    assert len(first_run.requests) == 4
    assert all(r.body["model"] == "fake-model" and r.path.endswith("/chat/completions") for r in first_run.requests)
    assert first_run.max_in_flight == 2


def test_attempts_rounds_samples_parse_status_and_parents(first_run: LoopRun) -> None:
    t = first_run.by_tag
    for tag, (rnd, parse_status, _) in EXPECTED.items():
        assert (t[tag]["round"], t[tag]["parse_status"]) == (rnd, parse_status), tag
    assert {t["A"]["sample"], t["B"]["sample"]} == {0, 1} and {t["C"]["sample"], t["D"]["sample"]} == {0, 1}
    assert count(first_run.db, "SELECT count(*) FROM attempts WHERE run_id = ?", (first_run.run_id,)) == 4
    # Sources and hashes: the parsed candidate verbatim for code answers, nothing for prose.
    for tag, name in (("A", "correct.py"), ("B", "compile_error.py"), ("C", "wrong_scale.py")):
        assert t[tag]["sha256"] == hashlib.sha256(source(name).encode()).hexdigest(), tag
    assert t["D"]["sha256"] is None
    assert query(first_run.db, "SELECT parse_error FROM attempts WHERE id = ?", (t["D"]["attempt_id"],))[0][0]
    # Round 0 has no parents; round 1's parents are round-0 attempts: the correct one first where its
    # evaluation is clean (``loop.choose_parents``: the best clean attempt, then the latest failures
    # of distinct kinds by round and sample). Where it carries a flag (on a loaded CI host a contended
    # CPU timing, likely) it is no best, and both come in sample order (CI, session ac: [B, A]).
    round0 = {t["A"]["attempt_id"], t["B"]["attempt_id"]}
    assert t["A"]["parent_ids"] == [] and t["B"]["parent_ids"] == []
    from sandbox.result import EvalResult

    a_result = EvalResult.model_validate(t["A"]["evaluations"][0]["result"])
    by_sample = [t[x]["attempt_id"] for x in sorted("AB", key=lambda x: t[x]["sample"])]
    for tag in ("C", "D"):
        parents = t[tag]["parent_ids"]
        assert parents and set(parents) <= round0, (tag, parents)
        if a_result.clean:
            assert parents[0] == t["A"]["attempt_id"], (tag, parents)
        else:
            assert parents == by_sample, (tag, parents, [f.kind.value for f in a_result.flags])


def test_evaluations_verdicts_one_per_ok_attempt(first_run: LoopRun) -> None:
    t = first_run.by_tag
    for tag, (_, parse_status, verdict) in EXPECTED.items():
        evs = t[tag]["evaluations"]
        if parse_status != "ok":
            assert evs == [], tag
            continue
        assert len(evs) == 1, (tag, evs)
        assert evs[0]["status"] == verdict and evs[0]["reused_from"] is None, tag
        assert evs[0]["result"]["status"] == verdict
    assert count(first_run.db, "SELECT count(*) FROM evaluations WHERE run_id = ?", (first_run.run_id,)) == 3
    a, b, c = (t[x]["evaluations"][0] for x in "ABC")
    assert a["candidate_ms"] > 0 and a["eager_ms"] > 0 and a["speedup_eager"] > 0
    assert a["result"]["custom_calls_per_forward"] >= 1
    assert b["result"]["build"]["ok"] is False and "error" in b["result"]["build"]["first_error"].lower()
    # C has A's C++: the build cache served it. Its trials failed on the values.
    assert c["result"]["build"]["cached"] is True
    failed = [tr for tr in c["result"]["trials"] if not tr["passed"]]
    assert failed and failed[0]["outputs"][0]["max_abs_err"] > 0.01


def test_grounded_analysis_per_round(first_run: LoopRun) -> None:
    rows = query(first_run.db, "SELECT round, critic, markdown, model_call_id FROM analyses WHERE run_id = ? "
                               "ORDER BY id", (first_run.run_id,))
    assert [(r[0], r[1]) for r in rows] == [(0, "grounded"), (1, "grounded")]
    assert all(TASK_NAME in r[2] and r[3] is None for r in rows)
    # The grounded critic asks the model nothing: every request was a proposal.
    assert count(first_run.db, "SELECT count(*) FROM model_calls WHERE purpose != 'propose'") == 0


def test_round1_prompt_carries_round0_evidence(first_run: LoopRun) -> None:
    t = first_run.by_tag
    round1 = [r for r in first_run.requests if r.body["messages"] == t["C"]["messages"]]
    round0 = [r for r in first_run.requests if r.body["messages"] == t["A"]["messages"]]
    assert len(round1) == 2 and len(round0) == 2
    prompt, first_prompt = user_text(round1[0]), user_text(round0[0])
    a, b = t["A"]["evaluations"][0], t["B"]["evaluations"][0]
    compile_error = b["result"]["build"]["first_error"]
    evidence = {
        "the compiler's first error": compile_error,
        "the correct attempt's runtime": ms(a["candidate_ms"]),
        "the eager runtime": ms(a["eager_ms"]),
        "the correct attempt's source": source("correct.py").strip().splitlines()[-1].strip(),
        "the correct attempt's id": f"attempt {t['A']['attempt_id']}",
        "the failed attempt's id": f"attempt {t['B']['attempt_id']}",
    }
    for what, text in evidence.items():
        assert text in prompt, f"the round-1 prompt lacks {what}: {text!r}\n{prompt}"
    # The critic's round-0 analysis is in it too.
    analysis = query(first_run.db, "SELECT markdown FROM analyses WHERE run_id = ? AND round = 0",
                     (first_run.run_id,))[0][0]
    assert analysis.strip().splitlines()[0] in prompt
    # None of it could have been in round 0's prompt.
    assert compile_error not in first_prompt and f"attempt {t['A']['attempt_id']}" not in first_prompt


# ------------------------------------------------------------------ 3. runs and show

def test_runs_and_show_print_the_run(first_run: LoopRun, loop_env: pytest.MonkeyPatch) -> None:
    result = invoke(["runs", "--db", str(first_run.db)])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.strip("│ ").startswith(str(first_run.run_id)))
    assert "optimize" in line and "finished" in line and MODEL in line and "cpu" in line

    result = invoke(["show", str(first_run.run_id), "--db", str(first_run.db)])
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert flat(TASK_NAME) in out
    for word in ("finished", MODEL, "correct", "incorrect", "compile_error", "no_code"):
        assert word in out, word
    for row in first_run.by_tag.values():
        assert re.search(rf"│\s*{row['attempt_id']}\s*│\s*{row['round']}\s*│\s*{row['sample']}\s*│", result.output)

    # With a task: the attempts and the latest analysis.
    result = invoke(["show", str(first_run.run_id), TASK_NAME, "--db", str(first_run.db)])
    assert result.exit_code == 0, result.output
    assert "Analysis of" in result.output and flat(TASK_NAME) in flat(result.output)

    result = invoke(["show", "999", "--db", str(first_run.db)])
    assert result.exit_code == 2 and "no run 999" in result.output


# ------------------------------------------------------------------ 4. replay:RUN

def test_replay_model_reruns_from_stored_completions(first_run: LoopRun, loop_env: pytest.MonkeyPatch) -> None:
    before = count(first_run.db, "SELECT count(*) FROM evaluations")
    with serving(loop_env) as server:      # the env points at a server with nothing scripted...
        result = invoke(optimize_args(first_run.db, model=f"replay:{first_run.run_id}"))
        asked = list(server.requests)
    assert asked == [], f"replay asked the server {len(asked)} time(s)"     # ...and it was never asked
    assert result.exit_code == 0, result.output + repr(result.exception)
    new_id = query(first_run.db, "SELECT max(id) FROM runs")[0][0]
    assert new_id != first_run.run_id
    assert query(first_run.db, "SELECT kind, status, model FROM runs WHERE id = ?", (new_id,)) == \
        [("optimize", "finished", f"replay:{first_run.run_id}")]

    def verdicts(run_id: int) -> dict[tuple[int, int], tuple]:
        rows = query(first_run.db, """
            SELECT a.round, a.sample, a.parse_status, a.sha256, e.status, e.reused_from, c.response_text
            FROM attempts a JOIN model_calls c ON c.id = a.model_call_id
            LEFT JOIN evaluations e ON e.attempt_id = a.id WHERE a.run_id = ?""", (run_id,))
        return {(r[0], r[1]): r[2:] for r in rows}

    old, new = verdicts(first_run.run_id), verdicts(new_id)
    assert len(new) == 4 and sorted(new) == sorted(old)
    for key in old:
        assert new[key][:3] == old[key][:3], key                 # parse status, source hash, verdict
        assert new[key][4] == old[key][4], key                   # the same stored answer text
    # Nothing evaluated again: every verdict was reused from run 1's evaluations.
    reused = [v[3] for v in new.values() if v[2] is not None]
    old_ids = {r[0] for r in query(first_run.db, "SELECT id FROM evaluations WHERE run_id = ?", (first_run.run_id,))}
    assert len(reused) == 3 and set(reused) <= old_ids
    assert count(first_run.db, "SELECT count(*) FROM evaluations") == before + 3
    calls = query(first_run.db, "SELECT model, cost_usd FROM model_calls WHERE run_id = ?", (new_id,))
    assert calls == [(f"replay:{first_run.run_id}", 0.0)] * 4
    assert [r[0] for r in query(first_run.db, "SELECT round FROM analyses WHERE run_id = ? ORDER BY id",
                                (new_id,))] == [0, 1]


# ------------------------------------------------------------------ 2. evaluated once per source

def test_same_source_answered_twice_is_evaluated_once(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Round 0: the wrong-scale candidate twice (two samples of one round, evaluated side by
    side); round 1: it again, and prose. One evaluation; the others reuse it."""
    db = tmp_path / "store.db"
    with serving(loop_env) as server:
        server.reply(answer("wrong_scale.py", "W1")).reply(answer("wrong_scale.py", "W2"))
        server.reply(answer("wrong_scale.py", "W3")).reply(prose("P"))
        result = invoke(optimize_args(db))
        requests = list(server.requests)
    assert result.exit_code == 0, result.output + repr(result.exception)
    no_compiler_crash(db)
    rows = query(db, "SELECT e.id, e.status, e.reused_from, e.candidate_sha256, a.round FROM evaluations e "
                     "JOIN attempts a ON a.id = e.attempt_id ORDER BY a.round, a.sample")
    assert len(rows) == 3, rows
    fresh = [r for r in rows if r[2] is None]
    assert len(fresh) == 1 and fresh[0][4] == 0, rows
    assert [r[2] for r in rows if r[2] is not None] == [fresh[0][0]] * 2
    assert {r[1] for r in rows} == {"incorrect"}
    assert {r[3] for r in rows} == {hashlib.sha256(source("wrong_scale.py").encode()).hexdigest()}
    # The reused rows carry the same verdict and figures.
    results = {json.dumps(json.loads(r[0])["trials"]) for r in query(db, "SELECT result FROM evaluations")}
    assert len(results) == 1
    # Round 1's prompt quotes the mismatch of round 0.
    round1 = [user_text(r) for r in requests if "This is round 1" in user_text(r)]
    assert len(round1) == 2 and round1[0] == round1[1]
    trials = json.loads(query(db, "SELECT result FROM evaluations WHERE id = ?", (fresh[0][0],))[0][0])["trials"]
    check = next(tr for tr in trials if not tr["passed"])["outputs"][0]
    assert check["mismatched"] > 0 and check["max_abs_err"] > 0.01
    for text in (f"{check['mismatched']} of {check['numel']} elements outside", "max abs error",
                 "self.scale * 2.0"):
        assert text in round1[0], f"the round-1 prompt lacks the mismatch evidence {text!r}\n{round1[0]}"


def test_a_server_that_never_streams_loses_no_answer(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Default settings (stream = true) against a server that answers every request with a whole
    JSON completion: every answer with code is evaluated, none is lost as a parse error; the run
    says once that the server does not stream and stores that with the run."""
    db = tmp_path / "store.db"
    with serving(loop_env) as server:
        server.streams = False
        server.reply(answer("wrong_scale.py", "N1")).reply(answer("correct.py", "N2"))
        server.reply(answer("wrong_scale.py", "N3")).reply(prose("N4"))
        result = invoke(optimize_args(db))
        requests = list(server.requests)
    assert result.exit_code == 0, result.output + repr(result.exception)
    no_compiler_crash(db)
    # Round 0's two samples are asked at once, streamed; once an answer came whole, no more streaming.
    assert len(requests) == 4 and requests[0].body.get("stream") is True
    assert all("stream" not in r.body for r in requests[2:]), [r.body.get("stream") for r in requests]
    attempts = query(db, "SELECT a.parse_status, c.error, c.response_text, json_extract(c.context, '$.stream'), "
                         "(SELECT count(*) FROM evaluations e WHERE e.attempt_id = a.id) "
                         "FROM attempts a JOIN model_calls c ON c.id = a.model_call_id ORDER BY a.round, a.sample")
    by_tag = {tag_of(text): (status, error, stream, evals) for status, error, text, stream, evals in attempts}
    assert set(by_tag) == {"N1", "N2", "N3", "N4"}, attempts
    assert all(error is None and stream == "off" for _, error, stream, _ in by_tag.values()), attempts
    for tag in ("N1", "N2", "N3"):
        assert by_tag[tag][0] == "ok" and by_tag[tag][3] == 1, (tag, by_tag[tag])
    assert by_tag["N4"][0] == "no_code"
    assert flat(result.output).count(flat("(it does not stream)")) == 1, result.output
    notes = json.loads(query(db, "SELECT config FROM runs")[0][0])["backend_notes"]
    assert len(notes) == 1 and "does not stream" in notes[0] and "stream = false" in notes[0]


# ------------------------------------------------------------------ 6. bad input

def _nothing_stored(db: Path) -> None:
    for table in ("runs", "tasks", "model_calls", "attempts", "evaluations", "analyses"):
        assert count(db, f"SELECT count(*) FROM {table}") == 0, table


def test_task_with_a_syntax_error_is_named_and_nothing_is_stored(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    with serving(loop_env) as server:
        result = invoke(optimize_args(db, task=BAD_SYNTAX_TASK))
        assert server.requests == []
    assert result.exit_code == 2, result.output
    out = flat(result.output)
    assert flat(str(BAD_SYNTAX_TASK)) in out and "syntax" in out.lower() and "line6" in out, result.output
    assert "Traceback" not in result.output
    _nothing_stored(db)


def test_unknown_model_backend(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    result = invoke(optimize_args(db, model="foo:bar"))
    assert result.exit_code == 2, result.output
    assert "unknown model backend 'foo:bar'" in result.output and "openai:<arg>" in result.output
    assert "Traceback" not in result.output
    _nothing_stored(db)


def test_openai_model_without_api_key(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    with serving(loop_env) as server, pytest.MonkeyPatch.context() as mp:
        mp.delenv("OPENAI_API_KEY")
        result = invoke(optimize_args(db))
        assert server.requests == []
    assert result.exit_code == 2, result.output
    assert "OPENAI_API_KEY" in result.output and "no API key" in result.output
    assert "Traceback" not in result.output
    _nothing_stored(db)


def test_key_rejected_mid_run_fails_the_run(loop_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A 401 is a configuration error: the run stops, marked failed, with a message naming the key."""
    db = tmp_path / "store.db"
    with serving(loop_env) as server:
        server.unauthorized().unauthorized()
        result = invoke(optimize_args(db))
        asked = len(server.requests)
    assert result.exit_code == 2, result.output + repr(result.exception)
    assert "rejectedtheAPIkey" in flat(result.output)
    assert "OPENAI_API_KEY" in result.output
    assert 1 <= asked <= 2                                  # no retries of a 401
    assert query(db, "SELECT status FROM runs") == [("failed",)]
    assert count(db, "SELECT count(*) FROM evaluations") == 0


def test_progress_line_for_an_error_and_for_an_end_with_new_results() -> None:
    from agent.cli import progress_line
    from agent.loop import TaskProgress

    p = TaskProgress(name="t", round=2, attempts=6, correct=3, best_speedup=1.5)
    line, last = progress_line(p, None)
    assert line == "t: round 2 started (3 of 6 attempt(s) correct (0 clean) so far, best 1.5x vs eager)"
    assert progress_line(p, last) == (None, last)
    p.attempts, p.clean, p.stopped = 8, 2, "target 1.5x reached"
    assert progress_line(p, last)[0] == ("t: finished (target 1.5x reached); 3 of 8 attempt(s) correct (2 clean) "
                                         "so far, best 1.5x vs eager")
    p.stopped, p.error = "error", "RuntimeError: the store is gone"
    assert progress_line(p, last)[0] == "t: stopped: RuntimeError: the store is gone"


def test_parents_are_the_fastest_clean_attempt_then_the_latest_failures_of_distinct_kinds() -> None:
    """``choose_parents`` without the loop: a clean correct attempt leads whatever its sample; a correct
    one flagged ``contended`` (its timing not to be trusted) is no best, and counts as one more kind,
    in the order of rounds (latest first) and samples."""
    from agent.loop import choose_parents
    from agent.types import AttemptView
    from sandbox.result import EvalResult, Flag, FlagKind, Status

    def view(i: int, rnd: int, sample: int, status: Status, speedup: float = 1.0, flags=()) -> AttemptView:
        result = EvalResult(status=status, task="t", device="cpu",
                            speedup_eager=speedup if status is Status.correct else None,
                            flags=[Flag(kind=k, reason="test") for k in flags])
        return AttemptView(attempt_id=i, round=rnd, sample=sample, parse_status="ok", source="x", result=result)

    slow, fast = view(1, 0, 0, Status.correct, 1.2), view(2, 0, 1, Status.correct, 1.5)
    broken, wrong = view(3, 0, 2, Status.compile_error), view(4, 1, 0, Status.incorrect)
    assert choose_parents([slow, fast, broken, wrong]) == [2, 4, 3]       # fastest clean, then by recency
    busy = view(5, 0, 1, Status.correct, 3.0, [FlagKind.contended])
    assert choose_parents([broken, busy]) == [5, 3]                        # no clean one: sample order
    assert choose_parents([view(6, 0, 0, Status.compile_error), busy]) == [6, 5]
    assert choose_parents([slow, busy, broken]) == [1, 5, 3]               # the clean one leads, not the faster busy one
