"""The planted set, end to end on the CPU target: each candidate of ``tests/planted_set.py`` is
built, checked and timed by the sandbox, stored, and analysed by ``kernelloop critique``'s
path (``critique_run``: evidence read back from the store); each analysis must contain its
phrases, no analysis may label a speed its own interval contradicts, and the seed-format
export may quote only stored numbers.

Cost: two C++ builds (one shared by 15 candidates, one compile error), a 10 s hang, and about
a second of trials and timing per candidate. Marked ``slow``; CI runs it (scripts/test.sh runs
every marker).
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from planted_set import CASES, PLANTED, Case

from sandbox.result import EvalConfig
from sandbox.tasks import read_spec

pytestmark = pytest.mark.slow

CONFIG = EvalConfig(trials=2, warmup_runs=2, timed_runs=20, time_compile=False, run_timeout_s=10.0)


@dataclass
class Planted:
    store: object
    run_id: int
    attempts: dict[str, int]          # case name -> attempt id
    analyses: dict[str, str]          # task name -> markdown
    findings: dict[str, list[dict]]   # task name -> findings
    seconds: float


def _store_run(store, results, specs) -> tuple[int, dict[str, int]]:
    import torch

    from store.models import Attempt, Run
    from store.repo import evaluation_row, upsert_task

    ids = {}
    with store.session() as s:
        run = Run(model="planted", critic="grounded", device="cpu", device_name=results[0][1].device_name,
                  torch_version=torch.__version__, code_version="planted", config={})
        s.add(run)
        s.flush()
        task_ids = {name: upsert_task(s, spec).id for name, spec in specs.items()}
        for i, (case, result) in enumerate(results):
            att = Attempt(run_id=run.id, task_id=task_ids[case.task], round=1, sample=i, parse_status="ok",
                          source=case.source, sha256=result.candidate_sha256 or f"planted-{i}", parent_ids=[])
            s.add(att)
            s.flush()
            s.add(evaluation_row(result, task_key=f"planted-{case.task}", attempt_id=att.id, run_id=run.id))
            ids[case.name] = att.id
        return run.id, ids


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Planted:
    from agent.critic.cli import critique_run
    from sandbox.evaluate import Sandbox
    from store import Store
    from store.models import Analysis

    t0 = time.monotonic()
    specs = {name: read_spec(PLANTED / f"{name}.py", name=f"planted/{name}") for name in ("rows", "grid", "timed")}
    with Sandbox("cpu", CONFIG, build_slots=2) as sb:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [(c, pool.submit(sb.evaluate, specs[c.task], c.source)) for c in CASES]
            results = [(c, f.result()) for c, f in futures]
    store = Store(tmp_path_factory.mktemp("planted") / "planted.db")
    run_id, attempts = _store_run(store, results, specs)
    records = critique_run(store, run_id, critic="grounded")
    analyses = {r["task"]: r["markdown"] for r in records}
    findings = {}
    with store.reader() as s:
        for r in records:
            row = s.get(Analysis, r["analysis_id"])
            findings[r["task"]] = list(row.findings or [])
    return Planted(store, run_id, attempts, analyses, findings, time.monotonic() - t0)


def section(markdown: str, attempt_id: int) -> str:
    """The part of an analysis about one attempt (its section and its row of the table)."""
    m = re.search(rf"### Attempt {attempt_id} \(.*?(?=\n### |\n## )", markdown, re.S)
    assert m, f"no section for attempt {attempt_id}"
    return m.group(0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_planted_phrase(planted: Planted, case: Case):
    md = planted.analyses[f"planted/{case.task}"]
    text = section(md, planted.attempts[case.name])
    for phrase in case.phrases:
        assert phrase in text, f"{case.name}: {phrase!r} not in:\n{text}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_planted_category(planted: Planted, case: Case):
    cats = [f["category"] for fs in planted.findings.values() for f in fs
            if f.get("attempt_id") == planted.attempts[case.name]]
    assert case.category in cats, f"{case.name}: {case.category} not in {cats}"


def test_no_speed_label_contradicts_its_interval(planted: Planted):
    from agent.critic.uncertainty import contradictions

    claims = 0
    for md in planted.analyses.values():
        assert contradictions(md) == []
        claims += len(re.findall(r"\binterval \d", md))
    assert claims >= 3                                   # the three timing cases at least
    for fs in planted.findings.values():
        for f in fs:
            n = f.get("numbers") or {}
            if f["category"] == "faster":
                assert n["interval_low"] > 1.0
            elif f["category"] == "slower":
                assert n["interval_high"] < 1.0
            elif f["category"] == "inconclusive":
                assert n["interval_low"] <= 1.0 <= n["interval_high"]


def test_planted_numbers_are_stored_figures(planted: Planted):
    """Every number with a unit in the analyses is a stored figure."""
    import sqlalchemy as sa

    from agent.critic.evidence import attempt_views
    from agent.critic.numbers import check_text, evidence_figures
    from store.models import Task

    with planted.store.reader() as s:
        for task in s.scalars(sa.select(Task)).all():
            ev = evidence_figures(attempt_views(s, planted.run_id, task.id))
            assert check_text(planted.analyses[task.name], ev) == []


def test_planted_seed_documents_quote_only_stored_numbers(planted: Planted, tmp_path: Path):
    """``kernelloop export RUN --seed-format DIR`` on the planted run: per task, the candidates
    side by side and why; every number of each analysis (outside code) is a stored figure, and
    no speed label contradicts its interval."""
    import sqlalchemy as sa

    from agent.critic.evidence import attempt_views
    from agent.critic.numbers import check_every_number, evidence_figures
    from agent.critic.uncertainty import contradictions
    from evals.export import export_seed_format
    from store.models import Task

    with planted.store.reader() as s:
        paths = export_seed_format(s, planted.run_id, tmp_path)
        assert len(paths) == 3
        for path in paths:
            text = path.read_text()
            analysis = text[text.index(" **Solution Analysis** of"):]
            name = re.search(r"Solution Analysis\*\* of `([^`]+)`", analysis).group(1)
            task = s.scalars(sa.select(Task).where(Task.name == name)).one()
            views = attempt_views(s, planted.run_id, task.id)
            assert text.count("Kernel: \n") == len(views)
            assert check_every_number(analysis, evidence_figures(views), allowed=[-1.0]) == [], name
            assert contradictions(analysis) == []
            if name == "planted/timed":
                assert "### Why some are faster" in analysis and "Against the fastest: attempt" in analysis
