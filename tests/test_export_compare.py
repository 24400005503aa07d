"""``kernelloop export`` (JSONL, seed-format documents) and ``kernelloop compare``."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixture_store import ANALYSIS_MATMUL, MATMUL_V1, MATMUL_V2, TASKS, build_fixture_store  # noqa: E402

from evals.export import export_jsonl, export_seed_format, format_runtime  # noqa: E402
from evals.metrics import compare_metrics  # noqa: E402
from evals.run_data import load_run  # noqa: E402
from evals.report_cli import compare_command, export_command, report_command  # noqa: E402
from sandbox.result import EvalResult  # noqa: E402

SEEDS_DIR = Path("/work/shared/seeds")
# One attempt block of a seed document: "Kernel: \n<source>\n\nEvaluation: X \n\nRuntime: Y"
SEED_BLOCK = re.compile(r"Kernel: \n(.*?)\n\nEvaluation: (True|False) \n\nRuntime: (-?\d+(?:\.\d+)?)", re.S)


def parse_seed(text: str) -> tuple[list[tuple[str, bool, float]], str]:
    """(kernel, evaluation, runtime) per attempt, and the text after the last block (the analysis)."""
    blocks, end = [], 0
    for m in SEED_BLOCK.finditer(text):
        blocks.append((m.group(1), m.group(2) == "True", float(m.group(3))))
        end = m.end()
    return blocks, text[end:]


def cli_app() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report_command)
    app.command("export")(export_command)
    app.command("compare")(compare_command)
    return app


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    info = build_fixture_store(tmp_path_factory.mktemp("export"))
    yield info
    info.store.close()


# ------------------------------------------------------------------------ JSONL

@pytest.fixture(scope="module")
def jsonl(info, tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "run.jsonl"
    with info.store.reader() as s:
        counts = export_jsonl(s, info.run_a, path)
    lines = path.read_text().splitlines()
    return counts, [json.loads(line) for line in lines]


def test_jsonl_counts_and_order(info, jsonl):
    counts, records = jsonl
    assert counts == {"attempt": 9, "analysis": 3}
    assert [r["type"] for r in records] == ["attempt"] * 9 + ["analysis"] * 3
    assert {r["run_id"] for r in records} == {info.run_a}
    assert sorted(r["attempt_id"] for r in records[:9]) == sorted(info.attempts.values())


def test_jsonl_attempt_record(info, jsonl):
    _, records = jsonl
    by_id = {r["attempt_id"]: r for r in records if r["type"] == "attempt"}
    r = by_id[info.attempts["level1/matmul@2"]]
    assert r["task"]["name"] == "level1/matmul" and r["task"]["source"] == TASKS["level1/matmul"]
    assert r["round"] == 2 and r["sample"] == 0 and r["parse_status"] == "ok"
    assert r["messages"] == [{"role": "system", "content": "You write CUDA kernels."},
                             {"role": "user", "content": "Optimise level1/matmul (round 2)."}]
    assert r["completion"].startswith("Here is round 2:") and MATMUL_V2 in r["completion"]
    assert r["candidate_source"] == MATMUL_V2
    assert r["parent_ids"] == [info.attempts["level1/matmul@1"]]
    assert r["model_call"]["prompt_tokens"] == 1000 and r["model_call"]["completion_tokens"] == 500
    ev = EvalResult.model_validate(r["evaluation"])          # the full EvalResult, round-trips
    assert ev.clean and ev.speedup_eager == 2.5 and ev.candidate_time.median_ms == 1.6
    assert r["correct"] is True and r["runtime_ms"] == 1.6
    flagged = by_id[info.attempts["level2/conv_gn@0"]]
    assert flagged["correct"] is False and flagged["flagged"] is True
    assert EvalResult.model_validate(flagged["evaluation"]).flags[0].kind.value == "fallback"
    no_code = by_id[info.attempts["level2/lse@0"]]
    assert no_code["evaluation"] is None and no_code["candidate_source"] is None
    assert no_code["parse_status"] == "no_code" and no_code["runtime_ms"] == -1.0


def test_jsonl_analysis_records(info, jsonl):
    _, records = jsonl
    analyses = [r for r in records if r["type"] == "analysis"]
    assert [(a["task"]["name"], a["round"]) for a in analyses] == [
        ("level1/matmul", 0), ("level1/matmul", 2), ("level1/relu", 1)]
    assert analyses[1]["markdown"] == ANALYSIS_MATMUL
    assert analyses[1]["findings"][0]["attempt_id"] == info.attempts["level1/matmul@0"]
    assert analyses[1]["critic"] == "grounded" and analyses[1]["model_call_id"] is not None


# ------------------------------------------------------------------------ seed format

@pytest.fixture(scope="module")
def seeds(info, tmp_path_factory):
    out = tmp_path_factory.mktemp("seeds")
    with info.store.reader() as s:
        paths = export_seed_format(s, info.run_a, out)
    return out, paths


def test_seed_files(seeds):
    out, paths = seeds
    assert len(paths) == 4
    assert all(re.fullmatch(r"\d{3}_[0-9a-f]{16}\.txt", p.name) for p in paths)
    index = json.loads((out / "index.json").read_text())
    assert [d["task"] for d in index["documents"]] == sorted(TASKS)
    assert [d["file"] for d in index["documents"]] == [p.name for p in paths]


def test_seed_document_layout(info, seeds):
    out, _ = seeds
    index = {d["task"]: d["file"] for d in json.loads((out / "index.json").read_text())["documents"]}
    text = (out / index["level1/matmul"]).read_text()
    broken = MATMUL_V1.replace("acc += a", "acc += a[i] + a")
    blocks = (f"Kernel: \n{broken.rstrip()}\n\nEvaluation: False \n\nRuntime: -1.0\n"
              f"Kernel: \n{MATMUL_V1.rstrip()}\n\nEvaluation: True \n\nRuntime: 2.0\n"
              f"Kernel: \n{MATMUL_V2.rstrip()}\n\nEvaluation: True \n\nRuntime: 1.6\n")
    assert text.startswith(blocks)
    rest = text[len(blocks):]
    # the task, then the candidates side by side, why each is correct or not, why some are faster
    heads = [" **Solution Analysis** of `level1/matmul`", "```python\n" + TASKS["level1/matmul"].strip(),
             "### The candidates side by side", "### Why each is correct or not", "### Why some are faster",
             "### Summary of findings"]
    positions = [rest.index(h) for h in heads]
    assert positions == sorted(positions)
    assert "(Evaluation: False, Runtime: -1.0)**: compile error" in rest
    assert "(Evaluation: True, Runtime: 1.6)**: correct" in rest
    assert "Against the fastest: attempt" in rest                  # the slower correct one vs the fastest
    assert ANALYSIS_MATMUL.strip() not in rest                     # a stored (possibly llm) analysis is not copied


def test_seed_document_numbers_all_come_from_the_store(info, seeds):
    """Every number in every document's analysis (outside code) is a stored figure."""
    from agent.critic.evidence import attempt_views
    from agent.critic.numbers import check_every_number, evidence_figures
    from store.models import Task

    out, _ = seeds
    docs = json.loads((out / "index.json").read_text())["documents"]
    with info.store.reader() as s:
        for d in docs:
            task = s.scalars(__import__("sqlalchemy").select(Task).where(Task.name == d["task"])).first()
            views = attempt_views(s, info.run_a, task.id)
            _, rest = parse_seed((out / d["file"]).read_text())
            assert "Solution Analysis" in rest
            assert check_every_number(rest, evidence_figures(views), allowed=[-1.0]) == [], d["task"]


@pytest.mark.skipif(not SEEDS_DIR.is_dir(), reason="the user's example documents are not in this checkout")
def test_parser_reads_the_users_seed():
    """The parser used above reads the user's own example (so the layouts agree)."""
    text = next(SEEDS_DIR.glob("003_*.txt")).read_text(errors="replace")
    blocks, rest = parse_seed(text)
    assert len(blocks) == 4 and all(b[1] is False and b[2] == -1.0 for b in blocks)
    assert "Let me analyze" in rest


def test_seed_helpers():
    assert format_runtime(30.8) == "30.8" and format_runtime(2) == "2.0" and format_runtime(-1.0) == "-1.0"


# ------------------------------------------------------------------------ compare

@pytest.fixture(scope="module")
def comparison(info):
    with info.store.reader() as s:
        a, b = load_run(s, info.run_a), load_run(s, info.run_b)
    return compare_metrics(a.metrics, b.metrics)


def test_compare_rows(comparison):
    rows = {r["task"]: r for r in comparison["tasks"]}
    assert {t: r["change"] for t, r in rows.items()} == {
        "level1/matmul": "slower", "level1/relu": "newly_incorrect",
        "level2/conv_gn": "newly_correct", "level2/lse": "same"}
    mm = rows["level1/matmul"]
    assert mm["a"]["speedup_eager"] == 2.5 and mm["b"]["speedup_eager"] == 2.0
    assert mm["a"]["runtime_ms"] == 1.6 and mm["b"]["runtime_ms"] == 2.0
    assert mm["delta_speedup_eager"] == pytest.approx(-0.5) and mm["speedup_ratio"] == pytest.approx(0.8)
    assert rows["level2/conv_gn"]["a"]["status"] == "correct (flagged: fallback)"
    assert rows["level1/relu"]["b"]["status"] == "incorrect" and rows["level1/relu"]["b"]["runtime_ms"] == -1.0


def test_compare_summary(comparison):
    s = comparison["summary"]
    assert s["newly_correct"] == ["level2/conv_gn"] and s["newly_incorrect"] == ["level1/relu"]
    assert s["correct_a"] == 3 and s["correct_b"] == 3
    ga, gb = (2.5 * 0.8 * 1.2) ** (1 / 3), (2.0 * 1.5 * 1.2) ** (1 / 3)
    assert s["geomean_speedup_eager_a"] == pytest.approx(ga) and s["geomean_speedup_eager_b"] == pytest.approx(gb)
    assert s["geomean_change_eager"] == pytest.approx(gb / ga)
    assert s["geomean_ratio_common"] == pytest.approx((0.8 * 1.0) ** 0.5)   # matmul and lse
    assert s["fast_p_eager_b"]["1"] == 0.75 and s["fast_p_eager_a"]["1"] == 0.5


def test_compare_cli(info):
    runner = CliRunner()
    app = cli_app()
    res = runner.invoke(app, ["compare", str(info.run_a), str(info.run_b), "--db", str(info.db_path), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["run_a"] == info.run_a and data["summary"]["newly_correct"] == ["level2/conv_gn"]
    res = runner.invoke(app, ["compare", str(info.run_a), str(info.run_b), "--db", str(info.db_path)],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for text in ("level1/matmul", "newly_incorrect", "newly_correct", "newly correct in B: level2/conv_gn",
                 "newly incorrect in B: level1/relu", "geomean speedup vs eager: A 1.34x, B 1.53x"):
        assert text in res.stdout, text
    res = runner.invoke(app, ["compare", str(info.run_a), "77", "--db", str(info.db_path)])
    assert res.exit_code == 2 and "no run 77" in res.output


def test_export_cli(info, tmp_path):
    runner = CliRunner()
    app = cli_app()
    res = runner.invoke(app, ["export", str(info.run_a), "--db", str(info.db_path),
                              "--jsonl", str(tmp_path / "x.jsonl"), "--seed-format", str(tmp_path / "docs")])
    assert res.exit_code == 0, res.output
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 12
    assert len(list((tmp_path / "docs").glob("*.txt"))) == 4
    res = runner.invoke(app, ["export", str(info.run_a), "--db", str(info.db_path)])
    assert res.exit_code == 2 and "--jsonl" in res.output


def test_compare_says_when_the_runs_numerics_differ(tmp_path):
    """Two runs under different conventions are compared with a warning naming both labels;
    runs from before numerics were recorded read as fp32/strict."""
    from store.models import Run

    info = build_fixture_store(tmp_path)
    try:
        with info.store.session() as s:
            run = s.get(Run, info.run_b)
            run.config = {**run.config, "eval": {"trials": 5, "numerics": {"precision": "fp32", "math": "default"}}}
        runner = CliRunner()
        res = runner.invoke(cli_app(), ["compare", str(info.run_a), str(info.run_b), "--db", str(info.db_path),
                                        "--json"])
        assert res.exit_code == 0, res.output
        conv = json.loads(res.stdout)["numerics"]
        assert conv["a"] == "fp32/strict" and conv["b"] == "fp32/default" and conv["same"] is False
        res = runner.invoke(cli_app(), ["compare", str(info.run_a), str(info.run_b), "--db", str(info.db_path)],
                            env={"COLUMNS": "200"})
        assert "different numerics (A fp32/strict, B fp32/default)" in " ".join(res.stdout.split())
        res = runner.invoke(cli_app(), ["compare", str(info.run_a), str(info.run_a), "--db", str(info.db_path),
                                        "--json"])
        assert json.loads(res.stdout)["numerics"] == {"a": "fp32/strict", "b": "fp32/strict", "same": True,
                                                      "note": None}
    finally:
        info.store.close()
