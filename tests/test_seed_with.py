"""``optimize --model openai:... --seed-with builtin``: the model's first round refines the built-in's best.

Against the loopback server (``tests/fakeserver.py``), real C++ builds (the built-in's candidate
and the model's) and the real store. The real llama.cpp server runs the same path in
tests/test_real_server.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "loop"))
sys.path.insert(0, str(Path(__file__).parent))

from fakeserver import FakeOpenAI  # noqa: E402
from support import MODEL, answer, optimize_args, query, shared_cache_dir  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def invoke(args: list[str]):
    from kernelloop.cli import app

    return CliRunner().invoke(app, args)


@pytest.fixture
def env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KERNELLOOP_CACHE", str(shared_cache_dir(tmp_path_factory)))
    monkeypatch.setenv("KERNELLOOP_CONFIG", str(tmp_path_factory.mktemp("cfg") / "none.toml"))
    monkeypatch.delenv("KERNELLOOP_DB", raising=False)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    return monkeypatch


def test_model_round_refines_the_builtin_seed(env, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    with FakeOpenAI() as server:
        env.setenv("OPENAI_BASE_URL", server.url)
        env.setenv("OPENAI_API_KEY", "sk-fake-seed-test")
        server.reply(answer("correct.py", "M"))
        result = invoke(optimize_args(db, "--seed-with", "builtin", rounds=1, samples=1))
        requests = list(server.requests)
        remaining = server.remaining
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert remaining == 0 and len(requests) == 1          # the model answered round 1 only
    assert "round 0 by builtin" in result.output
    (model, config), = query(db, "SELECT model, config FROM runs")
    config = json.loads(config)
    assert model == MODEL and config["seed_with"] == "builtin" and config["rounds"] == 2
    rows = query(db, """SELECT a.id, a.round, a.parent_ids, a.source, c.model, c.template
                        FROM attempts a JOIN model_calls c ON c.id = a.model_call_id ORDER BY a.round""")
    assert [(r[1], r[4]) for r in rows] == [(0, "builtin"), (1, MODEL)]
    seed_id, seed_source = rows[0][0], rows[0][3]
    assert seed_source.startswith("# kernelloop-builtin: ")
    status, ms = query(db, "SELECT status, candidate_ms FROM evaluations WHERE attempt_id = ?", (seed_id,))[0]
    assert status == "correct" and ms
    # the model's first round: a refine prompt with the seed as the fastest correct attempt and parent
    assert rows[1][5] == "propose_refine" and json.loads(rows[1][2]) == [seed_id]
    prompt = next(m["content"] for m in requests[0].body["messages"] if m["role"] == "user")
    assert f"attempt {seed_id}" in prompt and "Write a faster `ModelNew` than" in prompt
    assert "kl_g0" in prompt                          # the seed's source, its generated kernel
    assert "This is round 1" in prompt


def test_seed_with_rejects_what_it_cannot_seed(env, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    env.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")     # never reached: refused before any call
    env.setenv("OPENAI_API_KEY", "sk-fake-seed-test")
    result = invoke(optimize_args(db, "--seed-with", "builtin", model="builtin"))
    assert result.exit_code != 0 and "--seed-with builtin seeds a model's run" in result.output
    result = invoke(optimize_args(db, "--seed-with", "replay:1"))
    assert result.exit_code != 0 and "--seed-with must be one of builtin" in result.output
    assert not db.exists() or not query(db, "SELECT id FROM runs")
