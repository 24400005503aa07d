"""The store: schema versioning from day one, pragmas, and one writer."""
from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa

from sandbox.tasks import TaskSpec
from store import Store, StoreError
from store.migrations import MIGRATIONS, SCHEMA_VERSION
from store.models import Base, Task
from store.repo import upsert_task


def test_new_store_has_every_table_the_models_describe(tmp_path):
    store = Store(tmp_path / "k.db")
    insp = sa.inspect(store.engine)
    for table in Base.metadata.sorted_tables:
        assert {c["name"] for c in insp.get_columns(table.name)} == {c.name for c in table.columns}, table.name
    assert store.version == SCHEMA_VERSION
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    store.close()


def test_an_older_store_is_upgraded_without_losing_rows(tmp_path):
    path = tmp_path / "old.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:          # a store written by the first release: migration 1 only
        conn.execute(sa.text("CREATE TABLE kernelloop_meta (key VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO kernelloop_meta VALUES ('app', 'kernelloop'), ('schema_version', '1')"))
        MIGRATIONS[0](conn)
        conn.execute(sa.text("INSERT INTO tasks (name, path, sha256, source, created_at) "
                             "VALUES ('seeds/x', '/x.py', 'abc', 'src', '2026-01-01 00:00:00')"))
    engine.dispose()
    store = Store(path)
    assert store.version == SCHEMA_VERSION
    with store.reader() as s:
        assert [t.name for t in s.scalars(sa.select(Task))] == ["seeds/x"]
        assert "runs" in sa.inspect(s.bind).get_table_names()
    store.close()


def test_a_newer_store_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "new.db"
    Store(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE kernelloop_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 5),))
    with pytest.raises(StoreError, match="newer than this kernelloop"):
        Store(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM kernelloop_meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION + 5)


def test_a_foreign_database_is_refused(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreError, match="not a kernelloop store"):
        Store(path)


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("these are not SQLite pages " * 200)
    with pytest.raises(StoreError, match="cannot be opened as a kernelloop store"):
        Store(path)


def test_url_and_environment_resolution(tmp_path, monkeypatch):
    from store.db import resolve_url

    monkeypatch.setenv("KERNELLOOP_DB", str(tmp_path / "env.db"))
    assert resolve_url(None).endswith("env.db")
    assert resolve_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert resolve_url(tmp_path / "x.db") == f"sqlite:///{tmp_path / 'x.db'}"


def test_tasks_are_unique_by_source_and_a_failed_write_keeps_earlier_rows(tmp_path):
    store = Store(tmp_path / "k.db")
    spec = TaskSpec(name="t/a", path="/a.py", source="print(1)")
    with store.session() as s:
        first = upsert_task(s, spec).id
    with store.session() as s:
        assert upsert_task(s, spec).id == first
    with pytest.raises(RuntimeError):
        with store.session() as s:
            upsert_task(s, TaskSpec(name="t/b", path="/b.py", source="print(2)"))
            raise RuntimeError("the writer failed half-way")
    with store.reader() as s:
        assert [t.name for t in s.scalars(sa.select(Task))] == ["t/a"]
    store.close()
