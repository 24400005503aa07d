"""scripts/backend_table.py (gpu_check.sh triton-table): its best is the fastest *clean* candidate,
by the same flags as ``EvalResult.clean``. Its own copy of the list lacked ``contended`` and
showed a contended candidate as the best (on an H100: 1.04x where the loop's clean best was 0.89x)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fixture_store import _add_attempt, _run, make_result
from sandbox.tasks import TaskSpec
from store import Store
from store.repo import upsert_task

ROOT = Path(__file__).resolve().parent.parent


def test_the_best_is_the_fastest_clean_candidate_and_a_contended_one_is_not(tmp_path):
    store = Store(tmp_path / "k.db")
    with store.session() as s:
        task = upsert_task(s, TaskSpec(name="level2/t", path="t.py", source="# t\n")).id
        run = _run(s)
        run.kind, run.backend = "optimize", "cuda"
        attempts: dict = {}
        fast = make_result("level2/t", "correct", cand=1.0, speedup_eager=2.0,
                           flags=(("contended", "the GPU was not quiet before the timed runs"),))
        slow = make_result("level2/t", "correct", cand=1.6, speedup_eager=1.25, flags=(("precision", "a note"),))
        wrong = make_result("level2/t", "incorrect", cand=0.5, speedup_eager=4.0)
        for rnd, result in enumerate((fast, slow, wrong)):
            _add_attempt(s, attempts, run.id, task, "level2/t", rnd, source=f"# {rnd}\n", result=result)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "backend_table.py"), str(tmp_path / "k.db")],
                         capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("| level2/t"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "cuda" and cells[6] == "1.600"        # the clean one, not the contended 1.0 ms
    assert cells[8] == "1.25x"


def test_each_row_says_its_numerics_and_a_strict_run_is_not_hidden_by_a_default_one(tmp_path):
    store = Store(tmp_path / "k.db")
    with store.session() as s:
        task = upsert_task(s, TaskSpec(name="level2/t", path="t.py", source="# t\n")).id
        attempts: dict = {}
        for i, numerics in enumerate(({"precision": "fp32", "math": "default"}, {"precision": "fp32", "math": "strict"},
                                      None)):
            run = _run(s)
            run.kind, run.backend = "optimize", f"cuda{i}" if numerics is None else "cuda"
            if numerics is not None:
                run.config = {"eval": {"numerics": numerics}}
            _add_attempt(s, attempts, run.id, task, "level2/t", i, source=f"# {i}\n",
                         result=make_result("level2/t", "correct", cand=1.0 + i, speedup_eager=1.0))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "backend_table.py"), str(tmp_path / "k.db")],
                         capture_output=True, text=True, check=True).stdout
    assert "| numerics |" in out.splitlines()[0]
    labels = sorted(line.split("|")[3].strip() for line in out.splitlines() if line.startswith("| level2/t"))
    assert labels == ["fp32/default", "fp32/strict", "not recorded"]
