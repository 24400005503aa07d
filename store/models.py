"""SQLAlchemy 2.0 typed models: the store's current shape.

The tables are created and changed only by ``store.migrations`` (append-only, frozen
DDL); these classes describe the schema the last migration leaves, and a test checks the
two agree. JSON columns hold pydantic dumps (``EvalResult``, run configs, messages).
"""
from __future__ import annotations

import datetime as dt
from typing import Any, Optional

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column, relationship


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Meta(Base):
    __tablename__ = "kernelloop_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Task(Base):
    __tablename__ = "tasks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    source: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class DeviceProbe(Base):
    __tablename__ = "device_probes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(64))
    bandwidth_gbps: Mapped[float] = mapped_column(Float)
    flops: Mapped[dict[str, Any]] = mapped_column(JSON)       # dtype -> TFLOP/s
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class Baseline(Base):
    __tablename__ = "baselines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    task_key: Mapped[str] = mapped_column(String(32))          # source hash + size overrides
    overrides: Mapped[dict[str, Any]] = mapped_column(JSON)
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(64))
    eager_ms: Mapped[Optional[float]] = mapped_column(Float)
    compile_ms: Mapped[Optional[float]] = mapped_column(Float)
    floor_ms: Mapped[Optional[float]] = mapped_column(Float)
    flops: Mapped[Optional[float]] = mapped_column(Float)
    min_bytes: Mapped[Optional[float]] = mapped_column(Float)
    details: Mapped[dict[str, Any]] = mapped_column(JSON)
    numerics: Mapped[Optional[str]] = mapped_column(String(32))  # precision/math mode, e.g. fp32/default
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    task: Mapped[Task] = relationship()


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="optimize")     # optimize | replay
    status: Mapped[str] = mapped_column(String(16), default="running")    # running | finished | failed | interrupted
    model: Mapped[str] = mapped_column(String(200))
    critic: Mapped[str] = mapped_column(String(32))
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(64))
    code_version: Mapped[str] = mapped_column(String(64))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    backend: Mapped[Optional[str]] = mapped_column(String(16))              # cuda | cpu | triton (sandbox.backends)
    parent_run_id: Mapped[Optional[int]] = mapped_column(ForeignKey("runs.id"))
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[Optional[dt.datetime]] = mapped_column(DateTime)


class ModelCall(Base):
    __tablename__ = "model_calls"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[Optional[int]] = mapped_column(ForeignKey("runs.id"), index=True)
    task_id: Mapped[Optional[int]] = mapped_column(ForeignKey("tasks.id"))
    round: Mapped[Optional[int]] = mapped_column(Integer)
    purpose: Mapped[str] = mapped_column(String(16))            # propose | critique
    model: Mapped[str] = mapped_column(String(200))
    template: Mapped[str] = mapped_column(String(200))
    prompt_sha256: Mapped[str] = mapped_column(String(64))
    messages: Mapped[list[Any]] = mapped_column(JSON)
    response_text: Mapped[Optional[str]] = mapped_column(Text)
    finish_reason: Mapped[Optional[str]] = mapped_column(String(32))
    prompt_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    completion_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    latency_s: Mapped[Optional[float]] = mapped_column(Float)
    cost_usd: Mapped[Optional[float]] = mapped_column(Float)
    error: Mapped[Optional[str]] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    reasoning: Mapped[Optional[str]] = mapped_column(Text)             # never fed back into prompts
    reasoning_tokens: Mapped[Optional[int]] = mapped_column(Integer)
    finish_cause: Mapped[Optional[str]] = mapped_column(String(32))    # stop | max_tokens | window | time_budget | stall | ...
    prompt_truncated: Mapped[Optional[bool]] = mapped_column(Boolean)  # the server counted far fewer prompt tokens
    context: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)    # window, counted prompt, max_tokens sent, left out


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "task_id", "round", "sample"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    round: Mapped[int] = mapped_column(Integer)
    sample: Mapped[int] = mapped_column(Integer)
    model_call_id: Mapped[Optional[int]] = mapped_column(ForeignKey("model_calls.id"))
    parse_status: Mapped[str] = mapped_column(String(32))      # ok | no_code | no_model_new | truncated | syntax_error | error
    parse_error: Mapped[Optional[str]] = mapped_column(Text)
    source: Mapped[Optional[str]] = mapped_column(Text)
    sha256: Mapped[Optional[str]] = mapped_column(String(64), index=True)
    parent_ids: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    task: Mapped[Task] = relationship()
    model_call: Mapped[Optional[ModelCall]] = relationship()
    evaluations: Mapped[list["Evaluation"]] = relationship(back_populates="attempt", order_by="Evaluation.id")


class Evaluation(Base):
    __tablename__ = "evaluations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[Optional[int]] = mapped_column(ForeignKey("attempts.id"), index=True)
    run_id: Mapped[Optional[int]] = mapped_column(ForeignKey("runs.id"), index=True)
    candidate_sha256: Mapped[str] = mapped_column(String(64), index=True)
    task_key: Mapped[str] = mapped_column(String(32))
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(64))
    config_hash: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32))
    candidate_ms: Mapped[Optional[float]] = mapped_column(Float)
    eager_ms: Mapped[Optional[float]] = mapped_column(Float)
    compile_ms: Mapped[Optional[float]] = mapped_column(Float)
    speedup_eager: Mapped[Optional[float]] = mapped_column(Float)
    speedup_compile: Mapped[Optional[float]] = mapped_column(Float)
    reused_from: Mapped[Optional[int]] = mapped_column(ForeignKey("evaluations.id"))
    result: Mapped[dict[str, Any]] = mapped_column(JSON)      # EvalResult.model_dump(mode="json")
    numerics: Mapped[Optional[str]] = mapped_column(String(32))  # precision/math mode, e.g. fp32/default
    # issue 15 (m006): NULL on rows judged before processes were contained and every timed run checked
    stray_processes_killed: Mapped[Optional[int]] = mapped_column(Integer)
    timed_runs_checked: Mapped[Optional[int]] = mapped_column(Integer)
    contended: Mapped[Optional[bool]] = mapped_column(Boolean)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    attempt: Mapped[Optional[Attempt]] = relationship(back_populates="evaluations")


class Analysis(Base):
    __tablename__ = "analyses"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    round: Mapped[int] = mapped_column(Integer)
    critic: Mapped[str] = mapped_column(String(32))            # grounded | llm
    markdown: Mapped[str] = mapped_column(Text)
    findings: Mapped[list[Any]] = mapped_column(JSON)
    model_call_id: Mapped[Optional[int]] = mapped_column(ForeignKey("model_calls.id"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class TaskStop(Base):
    """Why a task of a run ended without verdicts: ``too_large`` or ``error``, in words."""
    __tablename__ = "task_stops"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    status: Mapped[str] = mapped_column(String(32))             # too_large | error
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class _TaskOnDevice:
    """What keys a figure found for one task at its sizes, on one device, torch and numerics."""
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    task_key: Mapped[str] = mapped_column(String(32), index=True)     # source hash + size overrides
    device: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(64))
    numerics: Mapped[str] = mapped_column(String(32))                 # precision/math mode
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)

    @declared_attr
    def task(cls) -> Mapped[Task]:
        return relationship()


class TaskFootprint(_TaskOnDevice, Base):
    """A task's memory needs on one device under one numerics (``sandbox.footprint.Footprint``)."""
    __tablename__ = "task_footprints"
    params_bytes: Mapped[int] = mapped_column(BigInteger)
    inputs_bytes: Mapped[int] = mapped_column(BigInteger)
    outputs_bytes: Mapped[int] = mapped_column(BigInteger)
    fp64_bytes: Mapped[int] = mapped_column(BigInteger)
    forward_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    reference_resident_bytes: Mapped[int] = mapped_column(BigInteger)
    reference_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    candidate_peak_bytes: Mapped[int] = mapped_column(BigInteger)     # derived, kept for reading
    host_bytes: Mapped[int] = mapped_column(BigInteger)               # host memory of outputs in transit
    shm_bytes: Mapped[int] = mapped_column(BigInteger)                # files of outputs in transit
    oom: Mapped[Optional[str]] = mapped_column(Text)                  # the measurement ran out of memory
    details: Mapped[dict[str, Any]] = mapped_column(JSON)             # Footprint.to_dict()


class TaskCheck(_TaskOnDevice, Base):
    """The degeneracy checks' verdict on a task (``evals.taskcheck``): its flags as
    ``CheckIssue.to_dict()`` rows, empty when the task is fine."""
    __tablename__ = "task_checks"
    checker: Mapped[str] = mapped_column(String(32))                  # hash of the checks' source
    issues: Mapped[list[Any]] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(Float)                     # how long the checks took
