"""`kernelloop replay`: re-evaluates a stored run's candidates as a new run linked to the old one,
and shows old and new verdicts side by side."""
from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from typer.testing import CliRunner

from kernelloop.cli import app
from store import Store
from store.models import Attempt, Evaluation, Run

TASK = Path(__file__).parent / "adversarial" / "task_small.py"


def test_replay_reevaluates_a_stored_run_side_by_side(tmp_path):
    db = str(tmp_path / "k.db")
    runner = CliRunner()
    res = runner.invoke(app, ["optimize", str(TASK), "--model", "builtin", "--rounds", "1", "--samples", "2",
                              "--device", "cpu", "--no-compile", "--trials", "2", "--timed-runs", "3", "--db", db])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["replay", "1", "--device", "cpu", "--force", "--db", db])
    assert res.exit_code == 0, res.output
    assert "replay of run 1" in res.output and "correct" in res.output
    store = Store(db)
    with store.reader() as s:
        new = s.get(Run, 2)
        assert new.kind == "replay" and new.parent_run_id == 1 and new.status == "finished"
        old_attempts = list(s.scalars(sa.select(Attempt).where(Attempt.run_id == 1)))
        new_attempts = list(s.scalars(sa.select(Attempt).where(Attempt.run_id == 2)))
        assert len(new_attempts) == len(old_attempts) == 2
        assert sorted(a.sha256 for a in new_attempts) == sorted(a.sha256 for a in old_attempts)
        assert all(a.parent_ids == [o.id] for a, o in zip(new_attempts, old_attempts))
        fresh = list(s.scalars(sa.select(Evaluation).where(Evaluation.run_id == 2)))
        assert len(fresh) == 2 and all(e.reused_from is None for e in fresh)      # --force: evaluated again
    # Without --force, this machine's results for the same device, torch and config are reused.
    res = runner.invoke(app, ["replay", "1", "--device", "cpu", "--db", db])
    assert res.exit_code == 0, res.output
    with store.reader() as s:
        reused = list(s.scalars(sa.select(Evaluation).where(Evaluation.run_id == 3)))
        assert len(reused) == 2 and all(e.reused_from is not None for e in reused)
    store.close()


def test_replay_of_an_unknown_run_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(app, ["replay", "42", "--device", "cpu", "--db", str(tmp_path / "k.db")])
    assert res.exit_code == 2 and "no run 42" in res.output
