"""Exporting a run: JSONL (one record per attempt and per analysis) and seed-format documents.

JSONL records, one JSON object a line, attempts first (by task, round, sample), then analyses
(by id):

* ``{"type": "attempt", "run_id", "attempt_id", "task": {"name", "id", "sha256", "source"},
  "round", "sample", "parse_status", "parse_error", "messages" (the prompt), "completion"
  (the model's text), "model_call" (id, model, template, finish_reason, tokens, cost, latency,
  finish_cause, reasoning, reasoning_tokens, prompt_truncated, context),
  "candidate_source", "parent_ids", "evaluation_id", "evaluation" (the latest ``EvalResult``
  as JSON, or null), "correct" (``EvalResult.clean``), "flagged", "runtime_ms", "speedup_eager",
  "speedup_compile"}``; non-finite numbers (NaN, inf) are written as null
* ``{"type": "analysis", "run_id", "analysis_id", "task": {"name", "id"}, "round", "critic",
  "markdown", "findings", "model_call_id", "created_at"}``

Seed format: one text document per task, ``NNN_<task sha256[:16]>.txt``, shaped like the
user's example documents (``agent.critic.seed_doc``): per attempt (by round, sample)::

    Kernel: \\n<source>\\n\\nEvaluation: True|False \\n\\nRuntime: <ms>|-1.0\\n

then a blank line and an analysis written from the stored evidence alone: the task, the
candidates side by side with verdict and runtime, why each is correct or not, why some are
faster (each speed with its interval), a summary table. ``Evaluation`` is True only for a
correct kernel (``EvalResult.clean``: a flagged "correct" is False) and ``Runtime`` is then the
candidate's median in ms, otherwise -1.0; an attempt without code has an empty kernel. An
``index.json`` beside the documents maps each file to its task.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from evals.metrics import json_safe
from evals.run_data import RunData, load_run


def _attempt_rows(session, run_id: int) -> dict[int, tuple[Any, Optional[Any]]]:
    """attempt id -> (model call or None, latest evaluation or None)."""
    import sqlalchemy as sa
    from sqlalchemy.orm import selectinload

    from store.models import Attempt
    from store.repo import latest_evaluation

    out = {}
    for a in session.scalars(sa.select(Attempt).where(Attempt.run_id == run_id)
                             .options(selectinload(Attempt.evaluations), selectinload(Attempt.model_call))):
        out[a.id] = (a.model_call, latest_evaluation(a))
    return out


def jsonl_records(session, run_id: int, data: Optional[RunData] = None) -> Iterator[dict[str, Any]]:
    data = data or load_run(session, run_id)
    rows = _attempt_rows(session, run_id)
    for task in data.task_names:
        source = data.task_sources.get(task, "")
        task_info = {"name": task, "id": data.task_ids.get(task),
                     "sha256": hashlib.sha256(source.encode()).hexdigest(), "source": source}
        for rec in data.records_for(task):
            call, ev = rows.get(rec.attempt_id, (None, None))
            yield {
                "type": "attempt", "run_id": run_id, "attempt_id": rec.attempt_id, "task": task_info,
                "round": rec.round, "sample": rec.sample, "parse_status": rec.parse_status,
                "parse_error": rec.parse_error,
                "messages": list(call.messages or []) if call is not None else None,
                "completion": call.response_text if call is not None else None,
                "model_call": ({"id": call.id, "model": call.model, "template": call.template,
                                "finish_reason": call.finish_reason, "prompt_tokens": call.prompt_tokens,
                                "completion_tokens": call.completion_tokens, "cost_usd": call.cost_usd,
                                "latency_s": call.latency_s, "error": call.error,
                                "finish_cause": call.finish_cause, "reasoning": call.reasoning,
                                "reasoning_tokens": call.reasoning_tokens,
                                "prompt_truncated": call.prompt_truncated,
                                "context": call.context} if call is not None else None),
                "candidate_source": rec.source, "parent_ids": rec.parent_ids,
                "evaluation_id": ev.id if ev is not None else None,
                "evaluation": ev.result if ev is not None else None,
                "correct": rec.correct, "flagged": rec.flagged, "runtime_ms": rec.runtime_ms,
                "speedup_eager": rec.speedup_eager, "speedup_compile": rec.speedup_compile,
            }
    for a in data.all_analyses:
        yield {"type": "analysis", "run_id": run_id, "analysis_id": a["id"],
               "task": {"name": a["task"], "id": data.task_ids.get(a["task"])}, "round": a["round"],
               "critic": a["critic"], "markdown": a["markdown"], "findings": a["findings"],
               "model_call_id": a["model_call_id"], "created_at": a["created_at"]}


def export_jsonl(session, run_id: int, path: Path) -> dict[str, int]:
    """Write the JSONL export; returns the number of records by type."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"attempt": 0, "analysis": 0}
    with path.open("w", encoding="utf-8") as fh:
        for record in jsonl_records(session, run_id):
            fh.write(json.dumps(json_safe(record), ensure_ascii=False, allow_nan=False) + "\n")
            counts[record["type"]] += 1
    return counts


def format_runtime(ms: float) -> str:
    """The seeds' runtime: milliseconds as a float literal (``30.8``, ``2.0``), -1.0 when not correct."""
    return "-1.0" if ms is None or ms < 0 else repr(float(round(ms, 4)))


def export_seed_format(session, run_id: int, directory: Path, data: Optional[RunData] = None) -> list[Path]:
    """Write one seed-format document per task into ``directory``; returns the paths."""
    from agent.critic.evidence import attempt_views, device_facts, task_spec
    from agent.critic.seed_doc import seed_document as seed_analysis_document
    from store.models import Task
    from store.repo import get_run

    data = data or load_run(session, run_id)
    run = get_run(session, run_id)
    device = device_facts(session, run)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths, index = [], []
    for i, task in enumerate(data.task_names):
        sha = hashlib.sha256(data.task_sources.get(task, "").encode()).hexdigest()
        row = session.get(Task, data.task_ids.get(task))
        views = [v for v in attempt_views(session, run_id, row.id) if not (v.result and v.result.infra)]
        records = data.records_for(task)
        path = directory / f"{i:03d}_{sha[:16]}.txt"
        path.write_text(seed_analysis_document(task_spec(session, run, row, views), views, device), encoding="utf-8")
        paths.append(path)
        index.append({"file": path.name, "task": task, "task_sha256": sha, "attempts": len(views),
                      "correct": any(r.correct for r in records)})
    (directory / "index.json").write_text(json.dumps({"run_id": run_id, "documents": index}, indent=2) + "\n",
                                          encoding="utf-8")
    return paths
