"""scripts/suite_table.py: one per-task table over several runs and stores (a suite run in lanes)."""
from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from fixture_store import build_fixture_store  # noqa: E402
from suite_table import geomean, kind_of, main, read, table  # noqa: E402


def _row(text: str, task: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith(f"| {task} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _run_a(tmp_path):
    """The fixture store's run A, read as the table reads it: its records and (device, numerics) pairs."""
    info = build_fixture_store(tmp_path)
    try:
        return read([f"{info.db_path}:{info.run_a}"])
    finally:
        info.store.close()


def test_a_suite_table_takes_each_tasks_best_and_its_best_after_each_round(tmp_path):
    records, seen = _run_a(tmp_path)
    assert len(seen) == 1
    text = table(records)
    # matmul: round 0 a compile error, round 1 1.5x compile, round 2 (its child) 1.875x
    assert _row(text, "level1/matmul")[1:] == ["other", "2.50x", "1.88x", "62.5", "-", "1.50x", "1.88x"]
    # relu: its round-1 attempt is incorrect, so round 0's best stays
    assert _row(text, "level1/relu")[2:4] == ["0.80x", "0.50x"]
    # conv_gn's only correct attempt is flagged fallback: no clean best, no speedup
    assert _row(text, "level2/conv_gn")[2:4] == ["-", "-"]
    kinds = {l.split("|")[1].strip(): l for l in text.splitlines() if l.startswith("| ") and "tasks" not in l}
    assert kinds["all"].split("|")[2].strip() == "4"                     # four tasks
    assert kinds["all"].split("|")[3].strip() == "3"                     # three with a clean kernel
    assert f"{geomean([2.5, 0.8, 1.2]):.2f}x" in kinds["all"]           # the geomean vs eager of those three


def test_tasks_whose_compiled_baseline_fails_the_tolerance_are_marked_and_counted(tmp_path):
    """A task whose evaluations found torch.compile's own output outside the tolerance (the stored
    EvalResult.compile_within_tolerance, read into AttemptRecord.compile_within) carries a † beside its
    best vs compile, and the table counts and names such tasks."""
    records, _ = _run_a(tmp_path)
    assert "torch.compile's own output outside the tolerance of eager's (†): 0 task(s)" in table(records)
    for r in records:
        if r.task == "level1/matmul":
            r.compile_within = False
    text = table(records)
    assert _row(text, "level1/matmul")[3] == "1.88x †" and "†" not in _row(text, "level1/relu")[3]
    assert "torch.compile's own output outside the tolerance of eager's (†): 1 task(s): matmul" in text


def test_tasks_whose_compiled_baseline_fails_the_float64_rule_are_marked_apart(tmp_path):
    """Within the tolerance but failing the float64 rule applied to candidates (the stored
    EvalResult.compile_fp64_note): a ‡, and a line naming them; a † task is not counted twice."""
    records, _ = _run_a(tmp_path)
    assert "(‡)" not in table(records)
    for r in records:
        if r.task in ("level1/matmul", "level1/relu"):
            r.compile_fp64 = "output 0: relative RMS error 0.000228 against the reference run in float64"
        if r.task == "level1/relu":
            r.compile_within = False
    text = table(records)
    assert _row(text, "level1/matmul")[3] == "1.88x ‡" and _row(text, "level1/relu")[3].endswith(" †")
    assert "failing the float64 rule applied to candidates (‡): 1 task(s): matmul" in text


def test_kinds_and_the_refusal_of_mixed_runs(tmp_path, capsys):
    assert kind_of("level2/72_ConvTranspose3d_BatchNorm_AvgPool_AvgPool") == "ConvTranspose"
    assert kind_of("level2/1_Conv2D_ReLU_BiasAdd") == "Conv2d"
    assert kind_of("level2/28_BMM_InstanceNorm_Sum_ResidualAdd_Multiply") == "GEMM/Matmul"
    info = build_fixture_store(tmp_path)
    info.store.close()
    out = tmp_path / "table.md"
    assert main([f"{info.db_path}:{info.run_a}", "--md", str(out)]) == 0
    assert "| level1/matmul |" in out.read_text() and "| all | 4 | 3 |" in out.read_text()
    # a run on another device is not pooled into one table
    with sqlite3.connect(info.db_path) as db:
        db.execute("update runs set device_name = 'another GPU' where id = ?", (info.run_b,))
    assert main([str(info.db_path)]) == 2
    assert "differ in device or numerics" in capsys.readouterr().err


def test_the_table_counts_contended_attempts_and_the_unsteady_windows_among_them(tmp_path):
    records, _ = _run_a(tmp_path)
    judged = [r for r in records if r.status is not None]
    assert "contended: 0 of %d evaluated attempts (0 of them" % len(judged) in table(records)
    judged[0].flags.append("contended")
    judged[0].flag_reasons.append("the reference's eager timing was not one steady window twice: ...")
    judged[1].flags.append("contended")
    judged[1].flag_reasons.append("the GPU was not quiet while the reference was timed: pid 1 used 4% of the SMs")
    assert f"contended: 2 of {len(judged)} evaluated attempts (1 of them a reference timing that was not one " \
           "steady window)" in table(records)


def test_the_conservative_line_takes_each_tasks_fastest_reference_and_counts_contended_candidates():
    """A graph candidate (0.5 ms) flagged contended because its evaluation's eager window ran slow
    (13 ms) counts against the task's fastest eager (4 ms) and compile (2 ms): 8x and 4x; a candidate
    flagged for anything else does not count."""
    from evals.metrics import AttemptRecord
    from suite_table import fastest_reference

    recs = [AttemptRecord(attempt_id=1, task="t", round=0, status="correct", clean=False, flags=["contended"],
                          candidate_ms=0.5, eager_ms=13.0, compile_ms=11.0),
            AttemptRecord(attempt_id=2, task="t", round=0, status="correct", clean=True,
                          candidate_ms=3.0, eager_ms=4.0, compile_ms=2.0),
            AttemptRecord(attempt_id=3, task="u", round=0, status="correct", clean=False, flags=["suspicious"],
                          candidate_ms=0.1, eager_ms=1.0, compile_ms=1.0),
            AttemptRecord(attempt_id=4, task="u", round=0, status="correct", clean=True,
                          candidate_ms=1.0, eager_ms=2.0, compile_ms=1.0)]
    line = fastest_reference(recs)
    # t: 4 / 0.5 = 8x eager, 2 / 0.5 = 4x compile; u: 1 / 1 = 1x both (the suspicious 0.1 ms is not counted)
    assert "geomean vs eager 2.83x, vs compile 2.00x over 2 tasks" in line, line


def test_the_median_line_reads_each_tasks_fastest_clean_candidate_against_its_typical_reference():
    """level2/82 in session ag: compile 7.09 ms in its first evaluation, 3.83-3.85 in the other three;
    the candidate's 3.45 ms read 2.04x against the first. Against the task's median compile time it
    reads 1.11x; a contended candidate does not count here."""
    from evals.metrics import AttemptRecord
    from suite_table import median_reference

    recs = [AttemptRecord(attempt_id=i + 1, task="82", round=i, status="correct", clean=True,
                          candidate_ms=cand, eager_ms=9.8, compile_ms=comp)
            for i, (cand, comp) in enumerate(((3.48, 7.09), (4.41, 3.84), (3.45, 3.85), (3.52, 3.83)))]
    recs.append(AttemptRecord(attempt_id=9, task="82", round=3, status="correct", clean=False, flags=["contended"],
                              candidate_ms=1.0, eager_ms=9.8, compile_ms=3.84))
    line = median_reference(recs)
    # median compile of (7.09, 3.84, 3.85, 3.83, 3.84) = 3.84; 3.84 / 3.45 = 1.11; eager 9.8 / 3.45 = 2.84
    assert "geomean vs eager 2.84x, vs compile 1.11x over 1 tasks" in line, line
