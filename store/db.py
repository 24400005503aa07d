"""Opening a store: URL resolution, SQLite pragmas, schema versioning.

``--db`` or ``KERNELLOOP_DB`` names a SQLite file (default ``./kernelloop.db``) or any
SQLAlchemy URL (``postgresql+psycopg://user@host/db``: the same code and migrations). Opening an older kernelloop store upgrades it in place, keeping every
row; a store written by a newer kernelloop, or a database that is not a kernelloop store,
is refused with a message that says which.

One writer: a ``Store`` serialises its write sessions with a lock, and the loop keeps all
writes in its main process (workers send results back; they never open the store). Several
drivers may share one PostgreSQL store (each run's rows are its own; migrations run under an
advisory lock, so drivers opening a new or older store at once upgrade it once).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from store.migrations import APP_ID, MIGRATIONS, SCHEMA_VERSION

DEFAULT_DB = "kernelloop.db"
# pg_advisory_xact_lock key held while a PostgreSQL store is checked and upgraded ("klmeta").
MIGRATION_LOCK = 0x6B6C6D657461


class StoreError(Exception):
    """The store cannot be opened or used; the message says why and what to do."""


def resolve_url(db: str | os.PathLike | None = None) -> str:
    raw = str(db) if db else os.environ.get("KERNELLOOP_DB") or DEFAULT_DB
    if "://" in raw:
        return raw
    return f"sqlite:///{Path(raw).expanduser().resolve()}"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


class Store:
    def __init__(self, db: str | os.PathLike | None = None, upgrade: bool = True):
        self.url = resolve_url(db)
        sqlite = self.url.startswith("sqlite")
        self.engine = sa.create_engine(self.url, future=True, **({} if sqlite else {"pool_pre_ping": True}))
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        try:
            self.version = self._check_and_upgrade(upgrade)
        except (DatabaseError, OperationalError) as exc:
            self.engine.dispose()
            raise StoreError(f"{self.url} cannot be opened as a kernelloop store: {exc.orig}") from None

    def _check_and_upgrade(self, upgrade: bool) -> int:
        with self.engine.begin() as conn:
            # One upgrader at a time: the others wait here and then find the store current.
            if conn.dialect.name == "postgresql":   # DDL is transactional there
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
            elif conn.dialect.name == "sqlite":     # the file's write lock now, not at the first write
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            tables = set(sa.inspect(conn).get_table_names())
            if not tables:
                current = 0
            elif "kernelloop_meta" not in tables:
                raise StoreError(
                    f"{self.url} is not a kernelloop store: it holds tables "
                    f"({', '.join(sorted(tables)[:6])}) but no kernelloop_meta. Point --db or "
                    f"KERNELLOOP_DB at a new file or an existing kernelloop store.")
            else:
                rows = dict(conn.execute(sa.text("SELECT key, value FROM kernelloop_meta")).all())
                if rows.get("app") != APP_ID:
                    raise StoreError(f"{self.url} has a kernelloop_meta table not written by kernelloop")
                current = int(rows.get("schema_version", "0"))
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.url} has schema version {current}, newer than this kernelloop knows "
                    f"({SCHEMA_VERSION}); upgrade kernelloop to use it (nothing was changed).")
            if current < SCHEMA_VERSION and not upgrade:
                raise StoreError(f"{self.url} has schema version {current}; it needs upgrading to {SCHEMA_VERSION}")
            if current == 0:
                conn.execute(sa.text(
                    "CREATE TABLE kernelloop_meta (key VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL)"))
                conn.execute(sa.text("INSERT INTO kernelloop_meta (key, value) VALUES ('app', :a)"), {"a": APP_ID})
                conn.execute(sa.text("INSERT INTO kernelloop_meta (key, value) VALUES ('schema_version', '0')"))
            for version in range(current, SCHEMA_VERSION):
                MIGRATIONS[version](conn)
                conn.execute(sa.text("UPDATE kernelloop_meta SET value = :v WHERE key = 'schema_version'"),
                             {"v": str(version + 1)})
        return SCHEMA_VERSION

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A write session: committed on success, rolled back on error, one at a time."""
        with self._write_lock:
            session = self._sessions()
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise
            finally:
                session.close()

    def reader(self) -> Session:
        """A session for reading only (no lock; the caller closes it)."""
        return self._sessions()

    def close(self) -> None:
        self.engine.dispose()
