"""Migration ``m009_task_stops`` (a file of its own, like ``m008_task_checks``; frozen once released).

Why a task of a run ended without verdicts: ``too_large`` (its memory needs exceed the device's
budget even alone, with the bytes needed and available) or ``error`` (the loop's own failure on
that task). Before, this was said only in the run's summary table: a report of a KernelBench
level-1 run counted 88 tasks, with nothing saying that 12 of the run's 100 were too large."""
from __future__ import annotations

import sqlalchemy as sa


def m009_task_stops(conn: sa.Connection) -> None:
    md = sa.MetaData()
    sa.Table("runs", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("tasks", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("task_stops", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False),
             sa.Column("status", sa.String(32), nullable=False),
             sa.Column("reason", sa.Text, nullable=False),
             sa.Column("created_at", sa.DateTime, nullable=False))
    md.create_all(conn, tables=[md.tables["task_stops"]])
