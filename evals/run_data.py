"""One run read from the store, as the report, export and compare need it: ``load_run`` is the one
place that builds ``evals.metrics``' records (``AttemptRecord``, ``CallRecord``) from stored
attempts, evaluations and model calls; ``RunData`` holds them and computes the run's metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from evals.metrics import AttemptRecord, CallRecord, RunMetrics, compute_metrics


def first_error(result) -> Optional[str]:
    """The first thing that went wrong in an ``EvalResult``, in one line."""
    from sandbox.result import Status

    if result is None:
        return None
    if result.status is Status.compile_error and result.build is not None and result.build.first_error:
        return result.build.first_error.strip()
    if result.status is Status.incorrect:
        trial = result.first_failed_trial()
        if trial is not None and trial.reason:
            return trial.reason
    if result.error_message or result.error_type:
        msg = (result.error_message or "").strip().splitlines()
        text = msg[0] if msg else ""
        return f"{result.error_type}: {text}" if result.error_type else text
    if result.status is Status.correct and result.flags:
        return "; ".join(f"{f.kind.value}: {f.reason}" for f in result.flags)
    return None


@dataclass
class RunData:
    """Everything the report, export and compare need about one run, loaded at once."""

    run: dict[str, Any]
    records: list[AttemptRecord]
    calls: list[CallRecord]
    task_names: list[str]
    task_sources: dict[str, str]
    task_ids: dict[str, int]
    analyses: dict[str, dict[str, Any]]            # task -> latest analysis
    all_analyses: list[dict[str, Any]]
    parent_sources: dict[int, Optional[str]]      # attempt id -> source (parents outside the run too)
    not_run: dict[str, str] = field(default_factory=dict)   # the run's tasks with no attempt -> why

    _metrics: Optional[RunMetrics] = None

    @property
    def metrics(self) -> RunMetrics:
        if self._metrics is None:
            self._metrics = compute_metrics(self.records, self.calls, self.task_names)
        return self._metrics

    def records_for(self, task: str) -> list[AttemptRecord]:
        return sorted((r for r in self.records if r.task == task),
                      key=lambda r: (r.round, r.sample, r.attempt_id))

    def source_of(self, attempt_id: int) -> Optional[str]:
        for r in self.records:
            if r.attempt_id == attempt_id:
                return r.source
        return self.parent_sources.get(attempt_id)


def best_clean(data: RunData, limit: int, prefer: str = "Conv") -> list[AttemptRecord]:
    """Each task's fastest clean attempt (by its speedup vs eager), for at most ``limit`` tasks:
    those whose name holds ``prefer`` first, up to half of ``limit``, then the others, then more of
    ``prefer``'s (KernelBench's harness cross-checks such a mix: ``scripts/kb_harness.py --run``)."""
    best: dict[str, AttemptRecord] = {}
    for r in data.records:
        if r.clean and r.speedup_eager and r.source and (r.task not in best
                                                          or r.speedup_eager > (best[r.task].speedup_eager or 0)):
            best[r.task] = r
    liked = [best[t] for t in sorted(best) if prefer in t]
    other = [best[t] for t in sorted(best) if prefer not in t]
    first = liked[:limit // 2]
    rest = (other + liked[len(first):])[:limit - len(first)]
    return first + rest


def _record_from(attempt, name: str) -> AttemptRecord:
    from store.repo import eval_result, latest_evaluation

    rec = AttemptRecord(attempt_id=attempt.id, task=name, task_id=attempt.task_id, round=attempt.round,
                        sample=attempt.sample, parse_status=attempt.parse_status,
                        parse_error=attempt.parse_error, parent_ids=list(attempt.parent_ids or []),
                        source=attempt.source)
    ev = latest_evaluation(attempt)
    if ev is None:
        if attempt.parse_status != "ok":
            rec.error = f"{attempt.parse_status}: {attempt.parse_error}" if attempt.parse_error else attempt.parse_status
        return rec
    rec.evaluation_id = ev.id
    rec.status = ev.status
    rec.candidate_ms, rec.eager_ms, rec.compile_ms = ev.candidate_ms, ev.eager_ms, ev.compile_ms
    rec.speedup_eager, rec.speedup_compile = ev.speedup_eager, ev.speedup_compile
    try:
        result = eval_result(ev)
    except Exception:  # an evaluation this version cannot parse: keep the columns, never clean
        rec.error = "stored evaluation result could not be read"
        return rec
    rec.clean = result.clean
    rec.flags = [f.kind.value for f in result.flags]
    rec.flag_reasons = [f.reason for f in result.flags]
    rec.floor_fraction = result.floor_fraction
    rec.compile_within = result.compile_within_tolerance
    rec.compile_fp64 = result.compile_fp64_note
    if result.candidate_time is not None:
        rec.timing = result.candidate_time.convention
    if result.correct:
        from sandbox.intervals import speedup_interval

        for name, base in (("speedup_eager_ci", result.eager_time), ("speedup_compile_ci", result.compile_time)):
            iv = speedup_interval(base, result.candidate_time)
            if iv is not None:
                setattr(rec, name, [iv.low, iv.high])
    rec.error = first_error(result)
    return rec


def evaluation_result(session, evaluation_id: int) -> dict[str, Any]:
    """A stored evaluation's ``EvalResult`` as a dict (the column holds JSON text or a dict)."""
    import json

    from store.models import Evaluation

    result = session.get(Evaluation, evaluation_id).result
    return json.loads(result) if isinstance(result, str) else result


def load_run(session, run_id: int) -> RunData:
    """Read one run from the store (raises LookupError for an unknown run)."""
    import sqlalchemy as sa
    from sqlalchemy.orm import selectinload

    from store.models import Analysis, Attempt, ModelCall, Task
    from store.repo import get_run, task_stops

    run = get_run(session, run_id)
    attempts = list(session.scalars(
        sa.select(Attempt).where(Attempt.run_id == run_id)
        .options(selectinload(Attempt.evaluations), selectinload(Attempt.task))
        .order_by(Attempt.task_id, Attempt.round, Attempt.sample, Attempt.id)))
    calls = list(session.scalars(sa.select(ModelCall).where(ModelCall.run_id == run_id).order_by(ModelCall.id)))
    analyses = list(session.scalars(sa.select(Analysis).where(Analysis.run_id == run_id).order_by(Analysis.id)))

    task_ids = {a.task_id for a in attempts} | {c.task_id for c in calls if c.task_id is not None} \
        | {a.task_id for a in analyses}
    tasks = {t.id: t for t in session.scalars(sa.select(Task).where(Task.id.in_(task_ids)))} if task_ids else {}
    # Task names are not unique across sources; disambiguate within the run.
    name_count: dict[str, int] = {}
    for t in tasks.values():
        name_count[t.name] = name_count.get(t.name, 0) + 1
    names = {tid: (t.name if name_count[t.name] == 1 else f"{t.name}#{tid}") for tid, t in tasks.items()}

    records = [_record_from(a, names[a.task_id]) for a in attempts]
    call_recs = [CallRecord(call_id=c.id, task=names.get(c.task_id) if c.task_id is not None else None,
                            round=c.round, purpose=c.purpose, prompt_tokens=c.prompt_tokens,
                            completion_tokens=c.completion_tokens, cost_usd=c.cost_usd) for c in calls]

    def analysis_dict(a) -> dict[str, Any]:
        return {"id": a.id, "task": names[a.task_id], "round": a.round, "critic": a.critic,
                "markdown": a.markdown, "findings": list(a.findings or []), "model_call_id": a.model_call_id,
                "created_at": a.created_at.isoformat() if a.created_at else None}

    all_analyses = [analysis_dict(a) for a in analyses]
    latest: dict[str, dict[str, Any]] = {}
    for a in all_analyses:   # ordered by id: the last one wins
        latest[a["task"]] = a

    in_run = {r.attempt_id for r in records}
    wanted = {pid for r in records for pid in r.parent_ids[:1] if isinstance(pid, int) and pid not in in_run}
    parent_sources: dict[int, Optional[str]] = {}
    if wanted:
        for a in session.scalars(sa.select(Attempt).where(Attempt.id.in_(wanted))):
            parent_sources[a.id] = a.source

    # The run's tasks that have no attempt, and why (a stored stop: too_large, error), so a
    # report of a KernelBench level says how many of the level's tasks its figures cover.
    stops = task_stops(session, run_id)
    listed = [t for t in (run.config or {}).get("tasks", []) if isinstance(t, dict) and t.get("sha256")]
    by_sha = {t.sha256: t.id for t in session.scalars(
        sa.select(Task).where(Task.sha256.in_([t["sha256"] for t in listed])))} if listed else {}
    not_run: dict[str, str] = {}
    for t in listed:
        tid = by_sha.get(t["sha256"])
        if tid not in tasks:        # in no figure: no attempt, model call or analysis of it
            status, reason = stops.get(tid, ("", ""))
            if not status:
                reason = ("not reached: the run stopped before this task" if run.status != "finished" else
                          "no attempt, and no reason stored (stores before schema 9 kept none; "
                          "optimize --resume says it again)")
            not_run[str(t.get("name") or t.get("path"))] = reason or status

    run_info = {
        "id": run.id, "kind": run.kind, "status": run.status, "model": run.model, "critic": run.critic,
        "device": run.device, "device_name": run.device_name, "torch_version": run.torch_version,
        "code_version": run.code_version, "config": run.config, "parent_run_id": run.parent_run_id,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }
    return RunData(run=run_info, records=records, calls=call_recs, task_names=sorted(names.values()),
                   task_sources={names[tid]: t.source for tid, t in tasks.items()},
                   task_ids={names[tid]: tid for tid in tasks}, analyses=latest,
                   all_analyses=all_analyses, parent_sources=parent_sources, not_run=not_run)
