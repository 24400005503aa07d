"""Migration ``m008_task_checks`` (a file of its own, like ``m007_backend``; frozen once released).

The verdict of ``tasks check``'s degeneracy checks (``evals.taskcheck``) on one task, device, torch
and numerics, by one version of the checks (``checker``: a hash of their source). A check of
KernelBench's 250 tasks, about half an hour of one GPU, that is stopped part way goes on where it
stopped instead of checking every earlier task again."""
from __future__ import annotations

import sqlalchemy as sa


def m008_task_checks(conn: sa.Connection) -> None:
    md = sa.MetaData()
    sa.Table("tasks", md, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("task_checks", md,
             sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("task_id", sa.Integer, sa.ForeignKey("tasks.id"), nullable=False, index=True),
             sa.Column("task_key", sa.String(32), nullable=False, index=True),
             sa.Column("device", sa.String(16), nullable=False),
             sa.Column("device_name", sa.String(200), nullable=False),
             sa.Column("torch_version", sa.String(64), nullable=False),
             sa.Column("numerics", sa.String(32), nullable=False),
             sa.Column("checker", sa.String(32), nullable=False),
             sa.Column("issues", sa.JSON, nullable=False),
             sa.Column("seconds", sa.Float, nullable=False),
             sa.Column("created_at", sa.DateTime, nullable=False))
    md.create_all(conn, tables=[md.tables["task_checks"]])
