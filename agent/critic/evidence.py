"""Reading a run's stored evidence back into what critics take: ``AttemptView``s,
``DeviceFacts`` and the ``TaskSpec`` (with the sizes the run used).

Nothing here evaluates anything: an attempt's result is its latest ``Evaluation``'s
``result`` JSON, validated back into an ``EvalResult``. The loop uses ``attempt_views``
too, so the critic sees a task's history exactly as it is stored.
"""
from __future__ import annotations

from typing import Any, Optional

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.orm import Session

from agent.types import AttemptView, DeviceFacts
from sandbox.result import EvalResult
from sandbox.tasks import TaskSpec
from store.models import Attempt, Baseline, DeviceProbe, Evaluation, Run, Task
from store.repo import latest_evaluation, run_attempts


def stored_result(evaluation: Optional[Evaluation]) -> Optional[EvalResult]:
    """The ``EvalResult`` an evaluation row holds (None when absent or unreadable)."""
    if evaluation is None or not evaluation.result:
        return None
    try:
        return EvalResult.model_validate(evaluation.result)
    except ValidationError:
        return None


def attempt_view(attempt: Attempt) -> AttemptView:
    evaluation = latest_evaluation(attempt)
    return AttemptView(attempt_id=attempt.id, round=attempt.round, sample=attempt.sample,
                       parse_status=attempt.parse_status, source=attempt.source,
                       result=stored_result(evaluation), parse_error=attempt.parse_error,
                       parent_ids=[int(p) for p in (attempt.parent_ids or [])],
                       evaluation_id=evaluation.id if evaluation is not None else None)


def attempt_views(session: Session, run_id: int, task_id: int) -> list[AttemptView]:
    """Every attempt of one task in one run, in (round, sample) order, with its latest evaluation."""
    return [attempt_view(a) for a in run_attempts(session, run_id, task_id)]


def run_task_ids(session: Session, run_id: int) -> list[int]:
    rows = session.execute(sa.select(Attempt.task_id).where(Attempt.run_id == run_id)
                           .group_by(Attempt.task_id).order_by(sa.func.min(Attempt.id))).all()
    return [r[0] for r in rows]


def device_facts(session: Session, run: Run) -> DeviceFacts:
    """The run's device, with the latest stored probe of that device's ceilings (when one exists)."""
    probe = session.scalar(sa.select(DeviceProbe)
                           .where(DeviceProbe.device == run.device, DeviceProbe.device_name == run.device_name)
                           .order_by(DeviceProbe.id.desc()).limit(1))
    facts = DeviceFacts(device=run.device, name=run.device_name, torch_version=run.torch_version)
    if probe is not None:
        facts.bandwidth_gbps = probe.bandwidth_gbps
        facts.tflops = {str(k): float(v) for k, v in (probe.flops or {}).items() if v is not None}
    return facts


def _run_overrides(run: Run, task: Task) -> Optional[dict[str, Any]]:
    cfg = run.config or {}
    for key in ("overrides", "sizes", "set"):
        value = cfg.get(key)
        if isinstance(value, dict):
            per_task = value.get(task.name)
            if isinstance(per_task, dict):
                return dict(per_task)
            if all(not isinstance(v, dict) for v in value.values()):
                return dict(value)
    return None


def task_spec(session: Session, run: Run, task: Task, attempts: Optional[list[AttemptView]] = None) -> TaskSpec:
    """The task as the run evaluated it: its stored source and the size overrides it ran with.

    The overrides come from the baseline whose task key matches the evaluations' (that key
    hashes source and sizes), else from the run's configuration; on ``cpu`` the task's
    CPU_SIZES preset applies under them (critics call ``with_device_sizes``).
    """
    keys = set()
    for a in attempts or []:
        if a.evaluation_id is not None:
            ev = session.get(Evaluation, a.evaluation_id)
            if ev is not None:
                keys.add(ev.task_key)
    overrides: Optional[dict[str, Any]] = None
    if keys:
        base = session.scalar(sa.select(Baseline).where(Baseline.task_id == task.id, Baseline.task_key.in_(keys))
                              .order_by(Baseline.id.desc()).limit(1))
        if base is not None and isinstance(base.overrides, dict):
            overrides = dict(base.overrides)
    if overrides is None:
        overrides = _run_overrides(run, task) or {}
    return TaskSpec(name=task.name, path=task.path, source=task.source, overrides=overrides)
