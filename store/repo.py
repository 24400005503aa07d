"""Small, named write and read operations on the store, shared by every command."""
from __future__ import annotations

from typing import Optional

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sandbox.footprint import Footprint, FootprintBook
from sandbox.result import EvalConfig, EvalResult
from sandbox.tasks import TaskSpec
from store.models import Analysis, Attempt, Evaluation, Run, Task, TaskCheck, TaskFootprint, TaskStop


def call_fields(c, left_out: Optional[list[str]] = None) -> dict:
    """A ``Completion``'s figures as ``ModelCall`` columns (reasoning, limits, how the prompt was fitted)."""
    context = dict(getattr(c, "context", None) or {})
    if left_out:
        context["left_out"] = list(left_out)
    return {"response_text": c.text, "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens, "latency_s": c.latency_s, "cost_usd": c.cost_usd,
            "error": c.error, "reasoning": getattr(c, "reasoning", None),
            "reasoning_tokens": getattr(c, "reasoning_tokens", None),
            "finish_cause": getattr(c, "finish_cause", None),
            "prompt_truncated": bool(getattr(c, "prompt_truncated", False)),
            "context": context or None}


def upsert_task(session: Session, spec: TaskSpec) -> Task:
    task = session.scalar(sa.select(Task).where(Task.sha256 == spec.sha256))
    if task is None:
        if session.get_bind().dialect.name == "sqlite":   # one writer at a time: no one can race us
            task = Task(name=spec.name, path=spec.path, sha256=spec.sha256, source=spec.source)
            session.add(task)
            session.flush()
            return task
        try:        # another driver on the same server may insert the same task at this moment
            with session.begin_nested():
                task = Task(name=spec.name, path=spec.path, sha256=spec.sha256, source=spec.source)
                session.add(task)
        except IntegrityError:
            task = session.scalar(sa.select(Task).where(Task.sha256 == spec.sha256))
    return task


def cached_evaluation(session: Session, sha256: str, task_key: str, device_name: str,
                      torch_version: str, config: EvalConfig) -> Optional[Evaluation]:
    """An earlier evaluation of the same candidate on the same device, torch and config, judged with
    its processes contained and every timed run checked (rows from before m006 are not reused), and
    on ``cuda`` on a quiet device: a ``contended`` GPU evaluation says what the harness met, not what
    the candidate does, so the candidate is measured again (``agent.builtin.feedback.remeasured`` asks
    for that). A shared CPU host's bursts flag one evaluation in a few; those verdicts are reused."""
    return session.scalar(
        sa.select(Evaluation)
        .where(Evaluation.candidate_sha256 == sha256, Evaluation.task_key == task_key,
               Evaluation.device_name == device_name, Evaluation.torch_version == torch_version,
               Evaluation.config_hash == config.hash(), Evaluation.reused_from.is_(None),
               Evaluation.status != "infra_error",     # a harness failure is no verdict to reuse
               sa.or_(Evaluation.device != "cuda", Evaluation.contended.is_not(True)),
               Evaluation.stray_processes_killed.is_not(None))
        .order_by(Evaluation.id).limit(1))


def evaluation_row(result: EvalResult, task_key: str, attempt_id: Optional[int], run_id: Optional[int],
                   reused_from: Optional[int] = None) -> Evaluation:
    return Evaluation(
        attempt_id=attempt_id, run_id=run_id, candidate_sha256=result.candidate_sha256,
        task_key=task_key, device=result.device, device_name=result.device_name,
        torch_version=result.torch_version, config_hash=result.config.hash(),
        status=result.status.value,
        candidate_ms=result.candidate_time.median_ms if result.candidate_time else None,
        eager_ms=result.eager_time.median_ms if result.eager_time else None,
        compile_ms=result.compile_time.median_ms if result.compile_time else None,
        speedup_eager=result.speedup_eager, speedup_compile=result.speedup_compile,
        reused_from=reused_from, result=result.model_dump(mode="json"), numerics=result.config.numerics.label,
        stray_processes_killed=result.stray_processes_killed, timed_runs_checked=result.timed_runs_checked,
        contended=result.has_flag("contended"))


def eval_result(evaluation: Evaluation) -> EvalResult:
    return EvalResult.model_validate(evaluation.result)


def run_attempts(session: Session, run_id: int, task_id: Optional[int] = None) -> list[Attempt]:
    q = sa.select(Attempt).where(Attempt.run_id == run_id)
    if task_id is not None:
        q = q.where(Attempt.task_id == task_id)
    return list(session.scalars(q.order_by(Attempt.task_id, Attempt.round, Attempt.sample)))


def latest_evaluation(attempt: Attempt) -> Optional[Evaluation]:
    return attempt.evaluations[-1] if attempt.evaluations else None


def has_verdict(attempt: Attempt) -> bool:
    """Evaluated, and the latest evaluation is a verdict (not a harness failure, ``infra_error``,
    which ``optimize --resume`` evaluates again)."""
    latest = latest_evaluation(attempt)
    return latest is not None and latest.status != "infra_error"


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"no run {run_id} in this store (kernelloop runs lists them)")
    return run


def latest_analysis(session: Session, run_id: int, task_id: int) -> Optional[Analysis]:
    return session.scalar(sa.select(Analysis).where(Analysis.run_id == run_id, Analysis.task_id == task_id)
                          .order_by(Analysis.id.desc()).limit(1))


def save_footprint(session: Session, spec: TaskSpec, fp: Footprint, torch_version: str) -> TaskFootprint:
    row = TaskFootprint(
        task_id=upsert_task(session, spec).id, task_key=spec.key, device=fp.device, device_name=fp.device_name,
        torch_version=torch_version, numerics=fp.numerics, params_bytes=fp.params_bytes,
        inputs_bytes=fp.inputs_bytes, outputs_bytes=fp.outputs_bytes, fp64_bytes=fp.fp64_bytes,
        forward_peak_bytes=fp.forward_peak_bytes, reference_resident_bytes=fp.reference_resident_bytes,
        reference_peak_bytes=fp.reference_peak_bytes, candidate_peak_bytes=fp.candidate_peak_bytes,
        host_bytes=fp.host_transit_bytes, shm_bytes=fp.shm_bytes, oom=fp.oom, details=fp.to_dict())
    session.add(row)
    session.flush()
    return row


def latest_footprint(session: Session, task_key: str, device: str, numerics: str,
                     device_name: Optional[str] = None, torch_version: Optional[str] = None) -> Optional[Footprint]:
    """The newest footprint of the task (at these sizes) on ``device`` under ``numerics``; on
    this ``device_name`` and torch when given (another GPU model or torch is measured again)."""
    q = sa.select(TaskFootprint).where(TaskFootprint.task_key == task_key, TaskFootprint.device == device,
                                       TaskFootprint.numerics == numerics)
    if device_name is not None:
        q = q.where(TaskFootprint.device_name == device_name)
    if torch_version is not None:
        q = q.where(TaskFootprint.torch_version == torch_version)
    row = session.scalar(q.order_by(TaskFootprint.id.desc()).limit(1))
    return Footprint.from_dict(row.details) if row is not None else None


def footprint_book(store, device_name: str, torch_version: str) -> FootprintBook:
    """A ``FootprintBook`` that reads and writes this store (writes through its one-writer sessions)."""
    def load(spec: TaskSpec, device: str, numerics: str) -> Optional[Footprint]:
        with store.reader() as s:
            return latest_footprint(s, spec.key, device, numerics, device_name, torch_version)

    def save(spec: TaskSpec, fp: Footprint) -> None:
        with store.session() as s:
            save_footprint(s, spec, fp, torch_version)

    return FootprintBook(load=load, save=save)


def save_task_check(session: Session, spec: TaskSpec, where: dict, issues: list[dict], seconds: float) -> TaskCheck:
    """Store the degeneracy checks' verdict on ``spec``; ``where`` names device, device_name,
    torch_version, numerics and checker (``evals.taskcheck.checker_version``)."""
    row = TaskCheck(task_id=upsert_task(session, spec).id, task_key=spec.key, issues=issues, seconds=seconds, **where)
    session.add(row)
    session.flush()
    return row


def latest_task_check(session: Session, task_key: str, where: dict) -> Optional[list[dict]]:
    """The newest stored verdict on the task with exactly these ``where`` fields, else None."""
    q = sa.select(TaskCheck).where(TaskCheck.task_key == task_key,
                                   *(getattr(TaskCheck, k) == v for k, v in where.items()))
    row = session.scalar(q.order_by(TaskCheck.id.desc()).limit(1))
    return list(row.issues) if row is not None else None


def save_task_stop(session: Session, run_id: int, task_id: int, status: str, reason: str) -> TaskStop:
    """Why the run's task ended without verdicts (``too_large``, ``error``)."""
    row = TaskStop(run_id=run_id, task_id=task_id, status=status, reason=reason)
    session.add(row)
    session.flush()
    return row


def task_stops(session: Session, run_id: int) -> dict[int, tuple[str, str]]:
    """The run's latest stop of each task: task id -> (status, reason)."""
    rows = session.scalars(sa.select(TaskStop).where(TaskStop.run_id == run_id).order_by(TaskStop.id))
    return {r.task_id: (r.status, r.reason) for r in rows}
