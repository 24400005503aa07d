"""``scripts/rescore_steady.py``: stored evaluations re-judged by the steady-window rule, in a copy."""
from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import rescore_steady  # noqa: E402


def _timing(samples):
    s = sorted(samples)
    return {"median_ms": s[len(s) // 2], "iqr_ms": 0.0, "mean_ms": sum(s) / len(s), "min_ms": s[0],
            "max_ms": s[-1], "runs": len(s), "clock": "cuda_event", "samples_ms": samples}


def _rescored(tmp_path: Path, name: str, results: list[dict]) -> tuple[Path, sqlite3.Connection]:
    """A store of ``results`` (one evaluation each) in ``tmp_path/lane``, re-scored into ``tmp_path/out``:
    the original's path and the copy, open."""
    store = tmp_path / "lane" / name
    store.parent.mkdir()
    con = sqlite3.connect(store)
    con.execute("create table evaluations (id integer primary key, result json not null, contended boolean)")
    for i, r in enumerate(results, 1):
        con.execute("insert into evaluations values (?, ?, 0)", (i, json.dumps(r)))
    con.commit()
    con.close()
    out = tmp_path / "out"
    assert rescore_steady.main([str(out), str(store)]) == 0
    return store, sqlite3.connect(out / f"lane_{name}")


def test_only_unsteady_windows_are_flagged_and_only_in_the_copy(tmp_path):
    steady = {"eager_time": _timing([3.09] * 20), "compile_time": _timing([2.7] * 20),
              "candidate_time": _timing([2.0] * 19 + [6.0]), "flags": []}          # one slow run: steady
    burst = {"eager_time": _timing([6.2] * 11 + [3.09] * 9), "flags": [{"kind": "precision", "reason": "x"}]}
    slow_compile = {"eager_time": _timing([3.09] * 20), "compile_time": _timing([2.7] * 5 + [8.1] * 15)}
    candidate = {"eager_time": _timing([3.09] * 20), "candidate_time": _timing([2.0] * 9 + [6.0] * 11), "flags": []}
    store, copy = _rescored(tmp_path, "lane_0.db", [steady, burst, slow_compile, candidate])
    rows = {i: (json.loads(r), c) for i, r, c in copy.execute("select id, result, contended from evaluations")}
    assert rows[1][1] == 0 and rows[1][0]["flags"] == []
    assert rows[2][1] == 1 and [f["kind"] for f in rows[2][0]["flags"]] == ["precision", "contended"]
    assert "eager_time" in rows[2][0]["flags"][1]["reason"]
    assert rows[3][1] == 1 and "compile_time" in rows[3][0]["flags"][0]["reason"]
    assert rows[4][1] == 1 and "candidate_time" in rows[4][0]["flags"][0]["reason"]
    original = sqlite3.connect(store)
    assert [c for (c,) in original.execute("select contended from evaluations")] == [0, 0, 0, 0]


def test_an_eager_window_slow_and_steady_against_the_tasks_fastest_is_flagged(tmp_path):
    """28_VisionTransformer in session w: 13.3 ms in one evaluation, 3.9 in its twin's, both steady."""
    _, copy = _rescored(tmp_path, "lane_1.db", [{"task": task, "eager_time": _timing([eager] * 20), "flags": []}
                                                for task, eager in (("vit", 13.29), ("vit", 3.93), ("vit", 4.2),
                                                                    ("other", 13.29))])
    flagged = {i: c for i, c in copy.execute("select id, contended from evaluations")}
    assert flagged == {1: 1, 2: 0, 3: 0, 4: 0}
    (reason,) = [f["reason"] for f in json.loads(copy.execute("select result from evaluations where id = 1").fetchone()[0])["flags"]]
    assert "3.38x the task's fastest median in the store (3.93 ms)" in reason


def test_a_compiled_window_slow_and_steady_against_the_tasks_fastest_compiled_is_flagged(tmp_path):
    """level2/82 in session ag (one H100): its first compiled window read 7.09 ms, steady, the next
    three 3.83-3.85; the eager windows (9.8 ms) are their own kind and flag nothing."""
    _, copy = _rescored(tmp_path, "lane_2.db", [{"task": "82", "eager_time": _timing([9.8] * 20),
                                                 "compile_time": _timing([c] * 20), "flags": []}
                                                for c in (7.09, 3.84, 3.85, 3.83)])
    flagged = {i: c for i, c in copy.execute("select id, contended from evaluations")}
    assert flagged == {1: 1, 2: 0, 3: 0, 4: 0}
    (reason,) = [f["reason"] for f in json.loads(copy.execute("select result from evaluations where id = 1").fetchone()[0])["flags"]]
    assert reason.startswith("re-scored, not one steady window: compile_time: ") and "(3.83 ms)" in reason
