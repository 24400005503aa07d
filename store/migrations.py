"""Append-only schema migrations.

Each migration is a function of a connection, frozen once released: it describes the
tables as they were *at that version* (SQLAlchemy Core, so any SQLAlchemy backend works)
and never imports the ORM models. New needs get a new migration at the end of the list;
an existing one is never edited. ``kernelloop_meta.schema_version`` records how many ran.
"""
from __future__ import annotations

from typing import Callable

import sqlalchemy as sa

from store.migration_backend import m007_backend
from store.migration_task_checks import m008_task_checks
from store.migration_task_stops import m009_task_stops

APP_ID = "kernelloop"


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer, primary_key=True, autoincrement=True)


def _created() -> sa.Column:
    return sa.Column("created_at", sa.DateTime, nullable=False)


def m001_tasks_and_baselines(conn: sa.Connection) -> None:
    md = sa.MetaData()
    sa.Table("tasks", md, _id(),
             sa.Column("name", sa.String(200), nullable=False, index=True),
             sa.Column("path", sa.Text, nullable=False),
             sa.Column("sha256", sa.String(64), nullable=False, unique=True),
             sa.Column("source", sa.Text, nullable=False),
             _created())
    sa.Table("device_probes", md, _id(),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("bandwidth_gbps", sa.Float, nullable=False),
             sa.Column("flops", sa.JSON, nullable=False),
             _created())
    sa.Table("baselines", md, _id(),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False, index=True),
             sa.Column("task_key", sa.String(32), nullable=False),
             sa.Column("overrides", sa.JSON, nullable=False),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("eager_ms", sa.Float),
             sa.Column("compile_ms", sa.Float),
             sa.Column("floor_ms", sa.Float),
             sa.Column("flops", sa.Float),
             sa.Column("min_bytes", sa.Float),
             sa.Column("details", sa.JSON, nullable=False),
             _created())
    md.create_all(conn)


def m002_runs_calls_attempts_evaluations_analyses(conn: sa.Connection) -> None:
    md = sa.MetaData()
    sa.Table("tasks", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("runs", md, _id(),
             sa.Column("kind", sa.String(16), nullable=False),
             sa.Column("status", sa.String(16), nullable=False),
             sa.Column("model", sa.String(200), nullable=False),
             sa.Column("critic", sa.String(32), nullable=False),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("code_version", sa.String(64), nullable=False),
             sa.Column("config", sa.JSON, nullable=False),
             sa.Column("parent_run_id", sa.Integer, sa.ForeignKey("runs.id")),
             sa.Column("started_at", sa.DateTime, nullable=False),
             sa.Column("finished_at", sa.DateTime))
    sa.Table("model_calls", md, _id(),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), index=True),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id")),
             sa.Column("round", sa.Integer),
             sa.Column("purpose", sa.String(16), nullable=False),
             sa.Column("model", sa.String(200), nullable=False),
             sa.Column("template", sa.String(200), nullable=False),
             sa.Column("prompt_sha256", sa.String(64), nullable=False),
             sa.Column("messages", sa.JSON, nullable=False),
             sa.Column("response_text", sa.Text),
             sa.Column("finish_reason", sa.String(32)),
             sa.Column("prompt_tokens", sa.Integer),
             sa.Column("completion_tokens", sa.Integer),
             sa.Column("latency_s", sa.Float),
             sa.Column("cost_usd", sa.Float),
             sa.Column("error", sa.Text),
             _created())
    sa.Table("attempts", md, _id(),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False),
             sa.Column("round", sa.Integer, nullable=False),
             sa.Column("sample", sa.Integer, nullable=False),
             sa.Column("model_call_id", sa.Integer, sa.ForeignKey("model_calls.id")),
             sa.Column("parse_status", sa.String(32), nullable=False),
             sa.Column("parse_error", sa.Text),
             sa.Column("source", sa.Text),
             sa.Column("sha256", sa.String(64), index=True),
             sa.Column("parent_ids", sa.JSON, nullable=False),
             _created(),
             sa.UniqueConstraint("run_id", "task_id", "round", "sample"))
    sa.Table("evaluations", md, _id(),
             sa.Column("attempt_id", sa.Integer, sa.ForeignKey("attempts.id"), index=True),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), index=True),
             sa.Column("candidate_sha256", sa.String(64), nullable=False, index=True),
             sa.Column("task_key", sa.String(32), nullable=False),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("config_hash", sa.String(32), nullable=False),
             sa.Column("status", sa.String(32), nullable=False),
             sa.Column("candidate_ms", sa.Float),
             sa.Column("eager_ms", sa.Float),
             sa.Column("compile_ms", sa.Float),
             sa.Column("speedup_eager", sa.Float),
             sa.Column("speedup_compile", sa.Float),
             sa.Column("reused_from", sa.Integer, sa.ForeignKey("evaluations.id")),
             sa.Column("result", sa.JSON, nullable=False),
             _created())
    sa.Table("analyses", md, _id(),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False),
             sa.Column("round", sa.Integer, nullable=False),
             sa.Column("critic", sa.String(32), nullable=False),
             sa.Column("markdown", sa.Text, nullable=False),
             sa.Column("findings", sa.JSON, nullable=False),
             sa.Column("model_call_id", sa.Integer, sa.ForeignKey("model_calls.id")),
             _created())
    md.create_all(conn, tables=[t for name, t in md.tables.items() if name != "tasks"])


def m003_numerics(conn: sa.Connection) -> None:
    """Every baseline and evaluation says under which numerics convention (precision/math mode)
    it was measured. Rows from before: baselines ran PyTorch's defaults (fp32/default), the
    sandbox's evaluations ran IEEE fp32 with TF32 off (fp32/strict)."""
    for table, legacy in (("baselines", "fp32/default"), ("evaluations", "fp32/strict")):
        conn.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN numerics VARCHAR(32)"))
        conn.execute(sa.text(f"UPDATE {table} SET numerics = :label"), {"label": legacy})


def m004_task_footprints(conn: sa.Connection) -> None:
    """What a task needs in memory on a device under a numerics convention (sandbox.footprint),
    measured once and read by the sandbox's admission and by ``kernelloop tasks``."""
    md = sa.MetaData()
    sa.Table("tasks", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("task_footprints", md, _id(),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False, index=True),
             sa.Column("task_key", sa.String(32), nullable=False, index=True),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("numerics", sa.String(32), nullable=False),
             sa.Column("params_bytes", sa.BigInteger, nullable=False),
             sa.Column("inputs_bytes", sa.BigInteger, nullable=False),
             sa.Column("outputs_bytes", sa.BigInteger, nullable=False),
             sa.Column("fp64_bytes", sa.BigInteger, nullable=False),
             sa.Column("forward_peak_bytes", sa.BigInteger, nullable=False),
             sa.Column("reference_resident_bytes", sa.BigInteger, nullable=False),
             sa.Column("reference_peak_bytes", sa.BigInteger, nullable=False),
             sa.Column("candidate_peak_bytes", sa.BigInteger, nullable=False),
             sa.Column("host_bytes", sa.BigInteger, nullable=False),
             sa.Column("shm_bytes", sa.BigInteger, nullable=False),
             sa.Column("oom", sa.Text),
             sa.Column("details", sa.JSON, nullable=False),
             _created())
    md.create_all(conn, tables=[md.tables["task_footprints"]])


def m005_model_call_reasoning_and_limits(conn: sa.Connection) -> None:
    """Each model call keeps the reasoning the server returned apart from the answer (and its
    token count), which limit ended the answer (finish_cause: stop, max_tokens, window,
    time_budget, stall, broken, error), whether the server cut the prompt (prompt_truncated),
    and how the prompt was fitted (context: the window and its source, the prompt as counted,
    max_tokens sent, what was left out). Rows from before have none of these (NULL)."""
    columns = [("reasoning", sa.Text()), ("reasoning_tokens", sa.Integer()), ("finish_cause", sa.String(32)),
               ("prompt_truncated", sa.Boolean()), ("context", sa.JSON())]
    for name, type_ in columns:
        conn.execute(sa.text(f"ALTER TABLE model_calls ADD COLUMN {name} {type_.compile(dialect=conn.dialect)}"))


def m006_evaluation_containment(conn: sa.Connection) -> None:
    """Each evaluation says how many processes its candidate left running that the sandbox killed
    (stray_processes_killed), how many timed runs had their outputs checked (timed_runs_checked)
    and whether its timing was contended (issue 15). Rows from before were judged without
    containment or a check of every timed run: NULL, and never reused as a cached verdict."""
    columns = [("stray_processes_killed", sa.Integer()), ("timed_runs_checked", sa.Integer()),
               ("contended", sa.Boolean())]
    for name, type_ in columns:
        conn.execute(sa.text(f"ALTER TABLE evaluations ADD COLUMN {name} {type_.compile(dialect=conn.dialect)}"))


MIGRATIONS: list[Callable[[sa.Connection], None]] = [
    m001_tasks_and_baselines,
    m002_runs_calls_attempts_evaluations_analyses,
    m003_numerics,
    m004_task_footprints,
    m005_model_call_reasoning_and_limits,
    m006_evaluation_containment,
    m007_backend,          # store/migration_backend.py
    m008_task_checks,      # store/migration_task_checks.py
    m009_task_stops,       # store/migration_task_stops.py
]
SCHEMA_VERSION = len(MIGRATIONS)
