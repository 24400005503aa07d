"""The store: schema versioning from day one, pragmas, and one writer; on SQLite and on a real
PostgreSQL server (``store_url``, tests/conftest.py), the same code and migrations."""
from __future__ import annotations

import pytest
import sqlalchemy as sa

from sandbox.tasks import TaskSpec
from store import Store, StoreError
from store.migrations import MIGRATIONS, SCHEMA_VERSION
from store.models import Base, Task
from store.repo import upsert_task


def test_new_store_has_every_table_the_models_describe(store_url):
    store = Store(store_url)
    insp = sa.inspect(store.engine)
    for table in Base.metadata.sorted_tables:
        assert {c["name"] for c in insp.get_columns(table.name)} == {c.name for c in table.columns}, table.name
    assert store.version == SCHEMA_VERSION
    if store.engine.dialect.name != "sqlite":
        store.close()
        return
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    store.close()


def test_an_older_store_is_upgraded_without_losing_rows(store_url):
    path = store_url
    engine = sa.create_engine(store_url)
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


def test_a_newer_store_is_refused_and_left_unchanged(store_url):
    Store(store_url).close()
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE kernelloop_meta SET value = :v WHERE key = 'schema_version'"),
                     {"v": str(SCHEMA_VERSION + 5)})
    with pytest.raises(StoreError, match="newer than this kernelloop"):
        Store(store_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM kernelloop_meta WHERE key='schema_version'")).scalar() \
            == str(SCHEMA_VERSION + 5)
    engine.dispose()


def test_a_foreign_database_is_refused(store_url):
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE customers (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(StoreError, match="not a kernelloop store"):
        Store(store_url)


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


def test_tasks_are_unique_by_source_and_a_failed_write_keeps_earlier_rows(store_url):
    store = Store(store_url)
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


def test_stores_opened_at_once_on_a_new_database_migrate_it_once(store_url):
    """Drivers starting together on one new store: one creates the schema, the others wait
    for it (an advisory lock on PostgreSQL, the file lock on SQLite) and find it current."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: Store(store_url), range(4)))
    assert [s.version for s in stores] == [SCHEMA_VERSION] * 4
    with stores[0].engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, value FROM kernelloop_meta ORDER BY key")).all()
    assert rows == [("app", "kernelloop"), ("schema_version", str(SCHEMA_VERSION))]
    for s in stores:
        s.close()


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_two_stores_adding_the_same_task_at_once_keep_one_row(store_url):
    """Two drivers (two Stores, two connections) upsert the same task concurrently: one row,
    and both get its id (the loser's insert is rolled back to a savepoint). PostgreSQL only:
    a SQLite file has one writer (a second driver's write transaction may fail, never corrupt)."""
    import threading

    a, b = Store(store_url), Store(store_url)
    spec = TaskSpec(name="t/same", path="/same.py", source="print('same')")
    ids, barrier = [], threading.Barrier(2)

    def add(store):
        with store.session() as s:
            barrier.wait()
            ids.append(upsert_task(s, spec).id)

    threads = [threading.Thread(target=add, args=(st,)) for st in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with a.reader() as s:
        rows = list(s.scalars(sa.select(Task.id).where(Task.sha256 == spec.sha256)))
    assert len(rows) == 1 and ids == [rows[0], rows[0]]
    a.close()
    b.close()


def test_evaluations_judged_before_containment_are_not_reused(store_url):
    """m006: an evaluation row from before issue 15 (no stray count: judged without containment or a
    check of every timed run) is no cached verdict; one judged now is, and keeps its new columns."""
    from sandbox.result import EvalConfig, EvalResult, Status
    from store.models import Evaluation
    from store.repo import cached_evaluation, evaluation_row

    store = Store(store_url)
    config = EvalConfig()
    result = EvalResult(status=Status.correct, task="t/a", candidate_sha256="c" * 64, device="cpu",
                        device_name="cpu0", torch_version="2.x", config=config, timed_runs_checked=20)
    result.add_strays(["1 'sleep'"], "after its evaluation")
    with store.session() as s:
        old = evaluation_row(result, "key", None, None)
        old.stray_processes_killed = old.timed_runs_checked = old.contended = None     # as m006 leaves old rows
        s.add(old)
    with store.reader() as s:
        assert cached_evaluation(s, "c" * 64, "key", "cpu0", "2.x", config) is None
    with store.session() as s:
        s.add(evaluation_row(result, "key", None, None))
    with store.reader() as s:
        hit = cached_evaluation(s, "c" * 64, "key", "cpu0", "2.x", config)
        assert hit is not None and (hit.stray_processes_killed, hit.timed_runs_checked, hit.contended) == (1, 20, False)
        assert len(s.scalars(sa.select(Evaluation)).all()) == 2
    # a contended GPU evaluation is no verdict to reuse: the harness met a disturbed device, and the
    # same candidate is measured again (a CPU one is: a shared host's bursts flag one in a few)
    for device, sha, reused in (("cuda", "d", False), ("cpu", "e", True)):
        disturbed = result.model_copy(update={"candidate_sha256": sha * 64, "device": device}, deep=True)
        disturbed.add_flag("contended", "the device was not quiet")
        with store.session() as s:
            s.add(evaluation_row(disturbed, "key", None, None))
        with store.reader() as s:
            assert (cached_evaluation(s, sha * 64, "key", "cpu0", "2.x", config) is not None) is reused, device
    store.close()
